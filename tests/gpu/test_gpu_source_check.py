"""Device-agnostic rules, checked on the CPU (this file runs in CI; nothing in it needs a GPU).

1. The source check (:mod:`device_rules`, AST) over ``composer_plugins/``, the backend distributions in
   ``packages/`` and ``benchmarks/``: no ``.numpy()`` of a tensor that may be on a GPU, no ``np.asarray`` of
   one, no CPU-made tensor meeting one in arithmetic, an index or a same-device op, and no call of a helper
   whose device defaults to the CPU without a device. It must fail on planted offenders (checked here too).
2. The paths that hold the training tensors, run with every tensor on PyTorch's ``meta`` device: a tensor
   made on the CPU inside them meets a ``meta`` tensor and raises, as it would meet a CUDA one, and so does a
   ``.numpy()`` of one. The chunked kernels (log-probs, every divergence, top-k) forward and backward run
   this way (code that reads values — ``.item()``, ``nonzero()`` — cannot: the ``gpu`` tier covers it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from device_rules import check_source, check_tree

ROOT = Path(__file__).resolve().parents[2]
TREES = [
    ROOT / "composer_plugins",
    *sorted(p for p in (ROOT / "packages").glob("*/composer_plugins_*")),
    ROOT / "benchmarks",
]

#: Known offenders: (path, function) -> why it is tolerated and until when. Each entry must still match a
#: finding (a stale entry fails the test), so the list cannot outlive the bug it names.
KNOWN_OFFENDERS: dict[tuple[str, str], str] = {}


def _findings() -> list:
    out = []
    for tree in TREES:
        rel_root = tree.parent if tree.name != "benchmarks" else ROOT
        for f in check_tree(tree):
            rel = (rel_root / f.path).resolve().relative_to(ROOT).as_posix()
            out.append(type(f)(rel, f.line, f.function, f.rule, f.code))
    return out


def test_source_has_no_device_bugs():
    found = _findings()
    new = [f for f in found if (f.path, f.function) not in KNOWN_OFFENDERS]
    assert not new, "device bugs (see tests/gpu/device_rules.py; mark a false positive `# device-ok: why`):\n" + (
        "\n".join(map(str, new))
    )
    stale = set(KNOWN_OFFENDERS) - {(f.path, f.function) for f in found}
    assert not stale, f"KNOWN_OFFENDERS entries that no longer match a finding (fixed? remove them): {sorted(stale)}"


PLANTED = {
    "numpy": (
        "def encode(vec):\n"
        "    v = vec.detach().to(torch.float32).contiguous().view(-1)\n"
        "    return v.numpy().tobytes()\n"
    ),
    "numpy_attribute": "def grads(model):\n    return [p.grad.numpy() for p in model.parameters()]\n",
    "asarray": "def f(logits):\n    return np.asarray(logits.detach().float())\n",
    "asarray_local": "def f(x):\n    y = torch.softmax(x, -1)\n    return np.array(y)\n",
    "cross_device_binop": "def f(x):\n    return x + torch.arange(x.shape[-1])\n",
    "cross_device_index": (
        "def f(ro, rewards):\n    scores = torch.zeros(4, 8)\n    last = ro.mask.long().sum(-1) - 1\n"
        "    scores[torch.arange(4), last] = torch.tensor(rewards)\n    return scores\n"
    ),
    "cross_device_op": "def f(x, n):\n    return torch.cat([x, torch.zeros(x.shape[0], n)], 1)\n",
    "cross_device_method": "def f(x, rows):\n    return x.index_select(0, torch.tensor(rows))\n",
    "default_device": (
        "def f(policy, tok, texts):\n    ids, mask = tokenize_prompts(tok, texts, 64)\n    return policy(ids)\n"
    ),
}
CLEAN = {
    "cpu_first": "def f(t):\n    return t.detach().cpu().numpy()\n",
    "to_cpu": "def f(t):\n    x = t.detach().to('cpu').contiguous()\n    return x.view(-1).numpy().tobytes()\n",
    "to_cpu_device": "def f(t):\n    return t.to(device=torch.device('cpu')).numpy()\n",
    "cpu_constructor": "def f(b):\n    x = torch.frombuffer(bytearray(b), dtype=torch.uint8)\n    return x.numpy()\n",
    "item_tolist": "def f(t):\n    return t.sum().item(), t.tolist(), float(t.mean())\n",
    "device_kw": "def f(x):\n    return x + torch.arange(x.shape[-1], device=x.device)\n",
    "scalar": "def f(x):\n    return torch.where(x > 0, x, torch.tensor(0.0))\n",
    "cpu_only_locals": (
        "def f(n):\n    a = torch.zeros(n)\n    return torch.cat([a, torch.ones(n)]) + torch.arange(2 * n)\n"
    ),
    "cpu_index_of_a_gpu_tensor": "def f(x, rows):\n    return x[torch.tensor(rows)]\n",
    "cpu_indexed_by_cpu": "def f(n, rows):\n    a = torch.zeros(n)\n    a[torch.tensor(rows)] = 1\n    return a\n",
    "asarray_of_list": "def f(state):\n    return np.asarray(state[1], dtype=np.uint32)\n",
    "allowed": "def f(t):\n    return t.numpy()  # device-ok: t is built on the CPU by the caller\n",
    "device_given": "def f(tok, texts, x):\n    return tokenize_prompts(tok, texts, 64, x.device)\n",
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_the_check_fails_on_planted_offenders(name):
    found = check_source(PLANTED[name], f"planted_{name}.py")
    assert len(found) == 1, found
    want = next(r for r in ("numpy", "asarray", "cross_device", "default_device") if name.startswith(r))
    assert found[0].rule == want


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_the_check_accepts_cpu_side_code(name):
    assert check_source(CLEAN[name], f"clean_{name}.py") == []


def test_the_check_finds_a_planted_numpy_in_a_copy_of_the_real_tree(tmp_path):
    """A ``.numpy()`` planted into a copy of a real module (the kernels) is found, at its line."""
    src = (ROOT / "composer_plugins/kernels/chunked.py").read_text()
    planted = src + "\n\ndef leak(hidden):\n    return hidden.detach().float().numpy()\n"
    found = check_source(planted, "composer_plugins/kernels/chunked.py")
    assert [(f.function, f.rule) for f in found] == [("leak", "numpy")]
    assert found[0].line == planted.count("\n", 0, planted.index("return hidden")) + 1


# -- the training tensors' paths on the meta device --------------------------------------------------------
META = torch.device("meta")


def _meta_inputs(B: int = 2, T: int = 5, H: int = 8, V: int = 97) -> dict[str, torch.Tensor]:
    return {
        "hidden": torch.empty(B, T, H, device=META).requires_grad_(True),
        "teacher": torch.empty(B, T, H, device=META),
        "weight": torch.empty(V, H, device=META).requires_grad_(True),
        "ids": torch.empty(B, T, dtype=torch.long, device=META),
        "mask": torch.empty(B, T, dtype=torch.bool, device=META),
    }


def test_chunked_logprobs_on_meta():
    """(Masked rows are picked with ``nonzero()``, which needs values: that path runs on CUDA in the tier.)"""
    from composer_plugins.kernels.chunked import chunked_logprobs

    x = _meta_inputs()
    lp, ent = chunked_logprobs(x["hidden"], x["weight"], x["ids"], chunk_size=3, temperature=0.7, return_entropy=True)
    assert lp.device == META and ent.device == META
    lp.sum().backward()
    assert x["hidden"].grad.device == META and x["weight"].grad.device == META


@pytest.mark.parametrize("topk", [None, 7], ids=["full_vocab", "top7"])
# taid is not here: TAIDKernel.compute reads ``bool(isinf(zs).any())`` per chunk (a host sync, which meta
# tensors cannot answer); its device placement is covered by the CUDA runs of the tier
@pytest.mark.parametrize("criterion", ["jsd", "entropy_opd"])
@pytest.mark.parametrize("grad_mode", ["recompute", "precompute"])
def test_chunked_divergences_on_meta(criterion, topk, grad_mode):
    from composer_plugins.kernels.chunked import chunked_distill
    from composer_plugins.kernels.divergences import make_kernel, with_topk

    kernel = with_topk(make_kernel(criterion), topk)
    x = _meta_inputs()
    loss = chunked_distill(x["hidden"], x["teacher"], x["weight"], kernel, None, chunk_size=3, grad_mode=grad_mode)
    assert isinstance(loss, torch.Tensor) and loss.device == META
    loss.backward()
    assert x["hidden"].grad.device == META and x["weight"].grad.device == META
