# The README's two commands: `make bench` (the main job) and `make test`.
.PHONY: setup test bench lint typecheck
setup:
	bash scripts/setup.sh

test: setup
	.venv/bin/python -m pytest -q

bench: setup
	.venv/bin/layerlift bench ttft --quick --json bench/results/ttft_quick.json \
		--markdown bench/results/ttft_quick.md --plot bench/results/ttft_quick.png

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
