"""An engine driven over stdin/stdout, run inside a namespace host by the netns tests.

Usage: ``python agent.py '{"master": "H:P", "metadata": "...", ...}'``. It
prints ``{"event": "ready"}`` once the engine started, then answers one JSON
line per command line:

* ``{"op": "prefill", "tokens": [...]}`` → the request's result;
* ``{"op": "staged", "tokens": [...]}`` → lookup, load, commit, wait for
  layer 0 to land, print ``{"event": "landed"}``, read one more line (the
  test's "go", sent after it injected a fault), forward, print the result;
* ``{"op": "offloads"}`` (wait for offloads), ``{"op": "drop"}`` (drop the
  device cache), ``{"op": "quit"}``.

A result is ``{"restored", "computed", "recomputed", "reason", "logprobs"}``;
an exception is ``{"error": "..."}`` (the engine keeps running).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from layerlift import Engine, EngineConfig, HybridModel, ModelSpec, PrefillResult


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _readline() -> dict[str, Any]:
    line = await asyncio.to_thread(sys.stdin.readline)
    if not line:
        return {"op": "quit"}
    parsed: dict[str, Any] = json.loads(line)
    return parsed


def _result(r: PrefillResult) -> dict[str, Any]:
    return {
        "restored": r.restored_tokens,
        "computed": r.computed_tokens,
        "recomputed": r.recomputed_after_failure,
        "reason": r.fallback_reason,
        "logprobs": [float(x) for x in r.next_token_logprobs.flatten().tolist()],
    }


async def _staged(engine: Engine, tokens: list[int]) -> None:
    plan = await engine.lookup(tokens)
    handle = await engine.load([plan])
    try:
        readiness = handle.commit()
        await readiness.ready(0)
        _emit({"event": "landed", "boundary": plan.boundary})
        await _readline()  # the test's "go"
        results = await handle.forward()
    finally:
        await handle.aclose()
    _emit(_result(results[0]))


async def main(settings: dict[str, Any]) -> None:
    spec = ModelSpec.preset(settings.get("preset", "tiny"))
    model = HybridModel(spec, seed=0)
    cfg = EngineConfig(
        store=f"mooncake://{settings['master']}",
        metadata=settings.get("metadata", "P2PHANDSHAKE"),
        segment_bytes=0,
        pool_bytes=settings.get("pool_bytes", 64 << 20),
        store_timeout_s=settings.get("timeout_s", 5.0),
        policy=settings.get("policy", "overlap"),
        max_in_flight=settings.get("max_in_flight", 8),
        namespace=settings.get("namespace", "netns"),
    )
    async with Engine(model, cfg) as engine:
        _emit({"event": "ready"})
        while True:
            cmd = await _readline()
            op = cmd["op"]
            if op == "quit":
                return
            try:
                if op == "prefill":
                    _emit(_result((await engine.prefill([cmd["tokens"]]))[0]))
                elif op == "staged":
                    await _staged(engine, cmd["tokens"])
                elif op == "offloads":
                    report = await engine.wait_offloads()
                    _emit({"objects": report.objects, "failed": report.failed})
                elif op == "drop":
                    engine.drop_device_cache()
                    _emit({"dropped": True})
                else:
                    _emit({"error": f"unknown op {op!r}"})
            except Exception as exc:  # reported to the test, which decides
                _emit({"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
