"""The spot market as spotrun sees it: capacity traces per zone (real ones, replayed by the local
simulator and the deadline benchmark) and what an hour costs. A new trace format is one loader here."""
