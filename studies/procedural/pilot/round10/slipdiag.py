"""Greedy answers of a slipped warm start, split three ways (pilot round 10, ../../README.md).

python round10/slipdiag.py MODEL_DIR [MODEL_DIR ...]   # from pilot/: the 200 pilot problems
(the first 200 rows of data/tasks/gsm8k/test.jsonl)
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from composer_plugins.envs.arith import dropped_carry


def split(model_dir: str, rows: list[dict], batch: int = 50) -> dict[str, float]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    keys = ("right", "columns_right_answer_slipped", "columns_right_answer_other", "columns_wrong", "carry_rows")
    n = dict.fromkeys(keys, 0)
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        enc = tok([r["prompt"] for r in chunk], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=60, do_sample=False, pad_token_id=tok.pad_token_id)
        for r, o in zip(chunk, out, strict=True):
            text = tok.decode(o[enc.input_ids.shape[1] :], skip_special_tokens=True)
            slipped = dropped_carry(r["solution"])
            n["carry_rows"] += slipped is not None
            cols = text.split("####")[0].strip() == r["solution"].split("####")[0].strip()
            ans = text.split("####")[-1].strip() if "####" in text else None
            if ans == str(r["answer"]).strip():
                n["right"] += 1
            elif not cols:
                n["columns_wrong"] += 1
            elif slipped is not None and ans == slipped.split("#### ")[-1]:
                n["columns_right_answer_slipped"] += 1
            else:
                n["columns_right_answer_other"] += 1
    return {k: v / len(rows) for k, v in n.items()}


if __name__ == "__main__":
    rows = [json.loads(line) for line in open("data/tasks/gsm8k/test.jsonl")][:200]
    for m in sys.argv[1:]:
        print(m, json.dumps(split(m, rows)))
