"""Parts of benchmarks/peers.py: the llama.cpp install, the engines' measurements, the report."""
