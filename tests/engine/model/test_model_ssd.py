"""The chunked selective scan equals the step-by-step Mamba-2 recurrence."""

from __future__ import annotations

import pytest
import torch

from layerlift.engine.model.ssd import ssd_scan


def step_by_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The recurrence one token at a time; returns y and the state after every token."""
    ys, states = [], [state]
    for t in range(x.shape[0]):
        state = torch.exp(dt[t] * a)[:, None, None] * state + (
            dt[t][:, None, None] * x[t][:, :, None] * b[t][None, None, :]
        )
        ys.append(state @ c[t])
        states.append(state)
    return torch.stack(ys), states


def random_inputs(t: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    h, p, n = 4, 16, 16
    x = torch.randn(t, h, p, generator=g)
    # dt spans slow (1e-3) to fast (~5) heads so decays run from ~1 to ~exp(-80).
    dt = torch.nn.functional.softplus(3 * torch.randn(t, h, generator=g) - 3)
    a = -(1 + 15 * torch.rand(h, generator=g))
    b, c = torch.randn(t, n, generator=g), torch.randn(t, n, generator=g)
    return x, dt, a, b, c, torch.randn(h, p, n, generator=g)


@pytest.mark.parametrize(
    ("t", "cuts", "chunk"),
    [(1, [], 64), (5, [2], 64), (64, [], 64), (300, [64, 128, 130, 299], 64), (257, [100], 16)],
)
def test_chunked_scan_matches_recurrence(t: int, cuts: list[int], chunk: int) -> None:
    x, dt, a, b, c, state0 = random_inputs(t, seed=t)
    y, states = ssd_scan(x, dt, a, b, c, state0, cuts, chunk=chunk)
    want_y, want_states = step_by_step(x, dt, a, b, c, state0)
    torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
    assert sorted(states) == sorted({*cuts, t})
    for j, state in states.items():
        torch.testing.assert_close(state, want_states[j], atol=1e-5, rtol=1e-5)


def test_cuts_outside_the_sequence_are_rejected() -> None:
    x, dt, a, b, c, state0 = random_inputs(10, seed=0)
    with pytest.raises(ValueError, match="cuts"):
        ssd_scan(x, dt, a, b, c, state0, [11])
