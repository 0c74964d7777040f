.PHONY: install generate test bench

install:
	bash scripts/install.sh

# The main job: offline generation with the embedded default model.
generate: install
	antiphon generate "What is the capital of France?"

test: install
	@# pytest exits 5 when it collects nothing; that is a failure here too.
	python3 -m pytest -q tests

bench: install
	python3 benchmarks/offline_throughput.py
