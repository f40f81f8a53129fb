# The README's two commands: `make bench` (the main job) and `make test`.
.PHONY: setup test bench lint
setup:
	bash scripts/setup.sh

test: setup
	.venv/bin/python -m pytest -q

bench: setup
	.venv/bin/layerlift bench ttft --quick --json bench/results/ttft_quick.json \
		--markdown bench/results/ttft_quick.md --plot bench/results/ttft_quick.png

lint: setup
	.venv/bin/ruff check engine overlap pools linker layerlift tests bench
