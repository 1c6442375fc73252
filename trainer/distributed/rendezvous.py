"""Where a one-node job's ranks meet: names shared by the launcher (trainer/launch/start.py) and the agent
that serves torchrun's store on the launcher's socket (trainer/distributed/agent.py), kept below both."""

# one node: the loopback socket torchrun's store serves on (trainer/distributed/agent.py)
STORE_FD = "SPOTRUN_STORE_FD"
LOOPBACK = "127.0.0.1"
