# The README's two commands: `make bench` (the main job) and `make test`.
.PHONY: setup test test-hosts test-sglang test-vllm test-vllm033 bench results lint typecheck
# Where `make bench` writes its measurements: untracked (.gitignore), so the
# main job leaves the checkout clean. `make results` makes them the committed
# figures (bench/results/, docs/results.md, the README's headline).
BENCH_OUT ?= out/bench

setup:
	bash scripts/setup.sh

# The whole suite: LayerLift's own tests (the machine's kernels), the
# transformers architecture tests again under the other CPU kernel sets, and
# beside them the host tests in each host's own environment (built here when
# missing): two lanes side by side (scripts/test_all.sh).
test: setup
	bash scripts/test_all.sh

test-hosts: test-sglang test-vllm test-vllm033

test-sglang:
	bash scripts/setup_sglang.sh
	LAYERLIFT_HOST_TESTS=sglang .venv-sglang/bin/python -m pytest -q -m sglang tests/hosts/sglang_host

test-vllm:
	bash scripts/setup_vllm.sh
	LAYERLIFT_HOST_TESTS=vllm .venv-vllm/bin/python -m pytest -q -m vllm tests/hosts/vllm_host

# vLLM 0.33 (its GPU build) on CPU: its own classes, no model runs.
test-vllm033:
	bash scripts/setup_vllm033.sh
	LAYERLIFT_HOST_TESTS=vllm033 .venv-vllm033/bin/python -m pytest -q -m vllm033 tests/hosts/vllm033_host

bench: setup
	mkdir -p $(BENCH_OUT)
	.venv/bin/layerlift bench ttft --quick --json $(BENCH_OUT)/ttft_quick.json \
		--markdown $(BENCH_OUT)/ttft_quick.md --plot $(BENCH_OUT)/ttft_quick.png
	@echo "make bench: figures in $(BENCH_OUT)/ (not tracked by git);" \
		"'make results' makes them the committed ones"

# The explicit regeneration step: the last `make bench` becomes the committed
# record, docs/results.md is rebuilt from bench/results/*.json, and the
# README's headline is rewritten from the record.
results: setup
	test -f $(BENCH_OUT)/ttft_quick.json || { echo "run make bench first"; exit 2; }
	cp $(BENCH_OUT)/ttft_quick.json $(BENCH_OUT)/ttft_quick.md $(BENCH_OUT)/ttft_quick.png bench/results/
	.venv/bin/layerlift bench report
	.venv/bin/python scripts/readme_headline.py README.md bench/results/ttft_quick.json

# ruff, then the import layering (pyproject's [tool.importlinter] contracts).
# lint-imports reads packages from disk, so it runs on a tree of symlinks laid
# out as the installed package (layerlift.engine -> engine/, as for mypy below).
lint: setup
	.venv/bin/ruff check engine overlap pools linker layerlift tests bench examples
	rm -rf build/importlint && mkdir -p build/importlint/layerlift
	ln -s $(CURDIR)/layerlift/*.py $(CURDIR)/layerlift/testing $(CURDIR)/layerlift/hosts build/importlint/layerlift/
	for p in engine overlap pools linker bench; do ln -s $(CURDIR)/$$p build/importlint/layerlift/$$p; done
	cd build/importlint && ../../.venv/bin/lint-imports ../../pyproject.toml

# mypy cannot follow setuptools' package-dir mapping (layerlift.engine -> engine/),
# so it checks a tree of symlinks laid out as the installed package.
typecheck: setup
	rm -rf build/typecheck && mkdir -p build/typecheck/layerlift
	ln -s $(CURDIR)/layerlift/*.py $(CURDIR)/layerlift/testing $(CURDIR)/layerlift/hosts build/typecheck/layerlift/
	for p in engine overlap pools linker bench; do ln -s $(CURDIR)/$$p build/typecheck/layerlift/$$p; done
	cd build/typecheck && ../../.venv/bin/mypy --strict -p layerlift
