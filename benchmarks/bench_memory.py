"""Memory of one composed training step on CPU (issue 48), measured on a tiny Qwen2, extrapolated to Qwen2.5-0.5B.

1. **Activations held at the peak** (``torch.autograd.graph.saved_tensors_hooks``: unique storages saved for
   backward, parameters excluded) of a multi-micro-batch forward: the whole decoder body of each micro-batch under
   one checkpoint (before) against per-decoder-layer checkpointing (``compute.gradient_checkpointing: auto``).
   Peak = what the forward keeps + the largest region recomputed at once in backward (one micro-batch's body,
   or one layer of one micro-batch). The per-token, per-layer saved elements are fitted as ``a·H + b·I`` from two
   intermediate sizes, and the Qwen2.5-0.5B figures are that arithmetic, not a measurement.
2. **AdamW step temporaries**: bytes of the out-of-place results allocated inside ``optimizer.step()``
   (a ``TorchDispatchMode`` count) with ``foreach`` (CPU default now) and ``fused`` (CUDA default now).
3. **Policy-sized weight copies** of grpo + EMA hint teacher + replay DPO: fp32 policy, EMA teacher (fp32 before,
   the compute dtype now) and the DPO reference copy (before; now the pairs' cached log-probs).
4. **The TRL backend's copies** (issue 67): the same composition in ``ComposerGRPOTrainer`` under ``bf16``, the
   parameter bytes its module attributes hold besides the policy, against the policy's own (fp32) bytes.

Run: ``python -m benchmarks.bench_memory [--quick]``.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from composer_plugins.models.logprobs import completion_hidden, decoder_body, micro_batches, sequence_inputs
from composer_plugins.models.tiny import MODEL_SHAPES
from composer_plugins.training.step.ema import EMATeacher

GIB = 2**30


def _model(hidden: int = 128, inter: int = 384, layers: int = 3) -> Any:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).train()


def _saved(fn: Any, model: Any) -> int:
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _batch(rows: int, prompt: int, completion: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 512, (rows, prompt + completion), generator=g)
    ones = torch.ones(rows, prompt + completion, dtype=torch.long)
    return ids[:, :prompt], ones[:, :prompt], ids[:, prompt:], ones[:, prompt:]


def _whole_body(model: Any, batch: tuple[torch.Tensor, ...], mb: int) -> torch.Tensor:
    ids, att, pos = sequence_inputs(*batch)
    body, c = decoder_body(model), batch[2].shape[1]

    def run(i: torch.Tensor, a: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return body(input_ids=i, attention_mask=a, position_ids=p, use_cache=False).last_hidden_state[:, -(c + 1) : -1]

    return torch.cat(
        [checkpoint(run, ids[s], att[s], pos[s], use_reentrant=False) for s in micro_batches(len(ids), mb)]
    )


def activations(rows: int, prompt: int, completion: int, mb: int) -> dict[str, float]:
    """Saved bytes of a ``rows``-row forward in micro-batches of ``mb``: whole-body vs per-layer checkpointing."""
    plain = _model()
    layered = copy.deepcopy(plain)
    layered.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = _batch(rows, prompt, completion)
    one = tuple(t[:mb] for t in batch)
    n_layers = len(decoder_body(plain).layers)
    body = _saved(lambda: completion_hidden(plain, *one), plain)  # what one whole-body recompute holds
    out = {
        "none_all_activations": _saved(lambda: completion_hidden(plain, *batch, micro_batch_size=mb), plain),
        "whole_body_forward": _saved(lambda: _whole_body(plain, batch, mb), plain),
        "layer_forward": _saved(lambda: completion_hidden(layered, *batch, micro_batch_size=mb), layered),
        "one_micro_batch_body": body,
        "one_micro_batch_layer": body / n_layers,
    }
    out["whole_body_peak"] = out["whole_body_forward"] + body
    out["layer_peak"] = out["layer_forward"] + body / n_layers
    return out


def per_token_layer_elements(hidden: int, inter: int, tokens: int = 8 * 96) -> float:
    """fp32 elements saved per token per decoder layer (no checkpointing) for a 2-layer minus 1-layer model."""
    batch = _batch(8, 32, 64)
    two, one = _model(hidden, inter, 2), _model(hidden, inter, 1)
    diff = _saved(lambda: completion_hidden(two, *batch), two) - _saved(lambda: completion_hidden(one, *batch), one)
    return diff / 4 / tokens


class _Allocs(TorchDispatchMode):
    """Bytes of the results of out-of-place ops (``_``-suffixed in-place ops and ``out=`` writes excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if not name.endswith("_") and "out" not in (kwargs or {}):
            for t in out if isinstance(out, list | tuple) else [out]:
                if isinstance(t, torch.Tensor):
                    self.bytes += t.numel() * t.element_size()
        return out


def adamw_step_bytes(impl: str) -> dict[str, float]:
    model = _model()
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3, **{impl: True})
    for step in range(2):  # the first step allocates the states; the second is the steady state
        for p in params:
            p.grad = torch.full_like(p, 0.01 * (step + 1))
        if step == 1:
            with _Allocs() as a:
                opt.step()
        else:
            opt.step()
    n = sum(p.numel() for p in params)
    return {"bytes": a.bytes, "param_bytes_fp32": 4 * n}


def copies() -> dict[str, float]:
    policy = _model()
    p_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    head = policy.get_output_embeddings().weight
    ema32 = EMATeacher(policy, 0.05)
    ema16 = EMATeacher(policy, 0.05, dtype="bfloat16")
    return {
        "policy": p_bytes,
        "ema_fp32": sum(p.numel() * p.element_size() for p in ema32.parameters()),
        "ema_bf16": sum(p.numel() * p.element_size() for p in ema16.parameters()),
        "reference_fp32": p_bytes,
        "head_clone_fp32_per_step": head.numel() * 4,
    }


def trl_copies() -> dict[str, Any]:
    """Parameter bytes a built ``ComposerGRPOTrainer`` (grpo + EMA hint teacher + replay DPO, ``bf16``) holds in its
    module attributes besides the policy's own storages."""
    import tempfile

    try:
        from composer_plugins_trl.backend import ComposerGRPOTrainer
        from datasets import Dataset
        from trl import GRPOConfig
    except ImportError as e:
        return {"skipped": f"{e} (pip install composer-plugins-trl)"}
    from composer_plugins.models.tiny import TinyModelConfig, build_tiny_model, load_policy

    def hint(feedback: Any, prompt: str = "", completion: str = "", task: Any = None) -> str:
        return "The answer is even."

    pairs = [{"prompt": f"Q: {a}+{a}=? A:", "chosen": f" {2 * a}", "rejected": f" {2 * a + 1}"} for a in range(8)]
    with tempfile.TemporaryDirectory() as d:  # the tiny Qwen2 shape of the cases above
        model, tok = load_policy(build_tiny_model(TinyModelConfig(), [x["prompt"] + x["chosen"] for x in pairs], d))
        args = GRPOConfig(
            output_dir=d,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=8,
            use_cpu=True,
            bf16=True,
            report_to="none",
            disable_tqdm=True,
        )
        ema = {"name": "hint_distill", "weight": 0.5, "teacher": "ema", "ema_rate": 0.05}
        tr = ComposerGRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **k: [float(len(c) % 3) for c in completions],
            args=args,
            train_dataset=Dataset.from_list([{"prompt": x["prompt"]} for x in pairs]),
            processing_class=tok,
            channels=["policy", ema, {"name": "replay_dpo", "weight": 0.1}],
            hint_provider=hint,
            pairs=pairs,
        )
        held = {
            p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
            for m in vars(tr).values()
            if isinstance(m, torch.nn.Module)
            for p in m.parameters()
        }
        own = {p.untyped_storage().data_ptr() for p in model.parameters()}
        return {
            "policy": sum(n for k, n in held.items() if k in own),
            "copies": sum(n for k, n in held.items() if k not in own),
        }


def qwen_extrapolation(a: float, b: float, rows: int = 64, seq: int = 292, mb_rows: int = 14) -> dict[str, float]:
    """Qwen2.5-0.5B in bf16 (2 bytes), ``rows`` rows of ``seq`` tokens, micro-batches of ``mb_rows`` (arithmetic)."""
    s = MODEL_SHAPES["qwen2.5-0.5b"]
    H, inter, L, V = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    per_token_layer = (a * H + b * inter) * 2
    kv = H // s["num_attention_heads"] * s["num_key_value_heads"]
    layer_params = 2 * H * H + 2 * H * kv + 3 * H * inter + (H + 2 * kv) + 2 * H  # q,o; k,v; MLP; biases; norms
    params = V * H + L * layer_params + H  # tied embedding
    whole = mb_rows * seq * L * per_token_layer
    layer = rows * seq * L * H * 2 + mb_rows * seq * per_token_layer
    return {
        "params": params,
        "whole_body_peak_gib": whole / GIB,
        "layer_peak_gib": layer / GIB,
        "foreach_temporary_gib": 4 * params / GIB,
        "reference_copy_gib": 4 * params / GIB,
        "ema_fp32_to_bf16_saved_gib": 2 * params / GIB,
        "head_clone_fp32_gib": 4 * V * H / GIB,
    }


def run(quick: bool = False) -> dict[str, Any]:
    torch.set_num_threads(1)
    act = activations(rows=16 if quick else 64, prompt=32, completion=64, mb=4 if quick else 14)
    e1, e2 = per_token_layer_elements(128, 384), per_token_layer_elements(128, 768)
    b = (e2 - e1) / 384
    a = (e1 - b * 384) / 128
    adam = {impl: adamw_step_bytes(impl) for impl in ("foreach", "fused")}
    results = {
        "activations": act,
        "per_token_layer_elements": {"a_hidden": a, "b_intermediate": b},
        "adamw": adam,
        "copies": copies(),
        "trl_copies": (trl := trl_copies()),
        "qwen2.5-0.5b_arithmetic": qwen_extrapolation(a, b),
    }
    ratios = {
        "layer_vs_whole_body_peak": act["layer_peak"] / act["whole_body_peak"],
        "fused_vs_foreach_step_bytes": adam["fused"]["bytes"] / max(adam["foreach"]["bytes"], 1),
    }
    targets = {"layer_vs_whole_body_peak": "< 1", "fused_vs_foreach_step_bytes": "< 1"}
    if "copies" in trl:  # a bf16 EMA teacher (half the policy's fp32 bytes) and no reference copy: 0.5
        ratios["trl_copies_vs_policy"] = trl["copies"] / trl["policy"]
        targets["trl_copies_vs_policy"] = "<= 0.5"
    return {"name": "memory", "results": results, "ratios": ratios, "targets": targets}


if __name__ == "__main__":
    print(json.dumps(run(quick="--quick" in sys.argv), indent=2))
