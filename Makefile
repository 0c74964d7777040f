.PHONY: install serve generate chat test bench bench-serve

install:
	bash scripts/install.sh

# The main job: the server with the embedded default model, chat page at http://127.0.0.1:8000/
serve: install
	antiphon serve

generate: install
	antiphon generate "What is the capital of France?"

chat: install
	antiphon chat

# pytest exits 5 when it collects nothing, which fails here as it should.
test: install
	python3 -m pytest -q tests

bench: install
	python3 benchmarks/offline_throughput.py

bench-serve: install
	python3 benchmarks/serve.py
