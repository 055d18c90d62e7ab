"""Parts of benchmarks/loadgen.py: the precise emitter, the clients under test, and the figures."""
