"""Greedy completions of two models on the pilot problems: print the rows model A gets right and model B wrong.

python round6/dump.py MODEL_A MODEL_B [N]    # from studies/procedural/pilot/, on data/tasks/gsm8k/test.jsonl[:200]
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def greedy(model_dir: str, rows: list[dict], batch: int = 50) -> list[str]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    outs: list[str] = []
    for i in range(0, len(rows), batch):
        enc = tok([r["prompt"] for r in rows[i : i + batch]], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=60, do_sample=False, pad_token_id=tok.pad_token_id)
        outs += [tok.decode(o[enc.input_ids.shape[1] :], skip_special_tokens=True) for o in out]
    return outs


def right(text: str, row: dict) -> bool:
    return "####" in text and text.split("####")[-1].strip() == str(row["answer"]).strip()


def main(a_dir: str, b_dir: str, n: int = 8) -> None:
    torch.set_num_threads(1)
    with open("data/tasks/gsm8k/test.jsonl") as f:
        rows = [json.loads(line) for line in f][:200]
    a, b = greedy(a_dir, rows), greedy(b_dir, rows)
    shown = 0
    for row, x, y in zip(rows, a, b, strict=True):
        if right(x, row) and not right(y, row) and shown < n:
            shown += 1
            print("PROMPT", row["prompt"][-60:].replace("\n", " | "))
            print(" A:", x.replace("\n", " | "))
            print(" B:", y.replace("\n", " | "))
    print("A right", sum(map(right, a, rows)), "B right", sum(map(right, b, rows)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 8)
