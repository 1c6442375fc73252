"""Where a one-node job's ranks meet: names shared by the launcher (trainer/launch.py) and the agent that
serves torchrun's store on the launcher's socket (trainer/agent.py), kept below both."""

STORE_FD = "SPOTRUN_STORE_FD"  # one node: the loopback socket torchrun's store serves on (trainer/agent.py)
LOOPBACK = "127.0.0.1"
