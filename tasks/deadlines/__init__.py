"""Finish by a deadline for the least money: the market policy every provisioning decision consults
(`policy.py`, pure, one function per named policy), its simulation against a capacity trace on a
virtual clock (`simulate.py`) and the omniscient optimum it is measured against (`optimum.py`). A new
policy is one function and one line in `POLICIES`."""
