"""Split greedy accuracy into "every column line right" and "answer right" (pilot round 2, ../README.md).

python diag.py MODEL_DIR [MODEL_DIR ...]    # on the first 200 rows of data/tasks/gsm8k/test.jsonl
"""

from __future__ import annotations

import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def split_accuracy(model_dir: str, rows: list[dict], batch: int = 50) -> dict[str, float]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    cols = ans = both = 0
    for i in range(0, len(rows), batch):
        chunk = rows[i : i + batch]
        enc = tok([r["prompt"] for r in chunk], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=60, do_sample=False, pad_token_id=tok.pad_token_id)
        for r, o in zip(chunk, out, strict=True):
            text = tok.decode(o[enc.input_ids.shape[1] :], skip_special_tokens=True)
            c = text.split("####")[0].strip() == r["solution"].split("####")[0].strip()
            a = "####" in text and text.split("####")[-1].strip() == str(r["answer"]).strip()
            cols, ans, both = cols + c, ans + a, both + (c and a)
    n = len(rows)
    return {"columns": cols / n, "answer": ans / n, "both": both / n, "answer_given_columns": both / max(cols, 1)}


def main(models: list[str]) -> None:
    torch.set_num_threads(1)
    with open("data/tasks/gsm8k/test.jsonl") as f:
        rows = [json.loads(line) for line in f][:200]
    for m in models:
        s = split_accuracy(m, rows)
        print(
            f"{m} columns right {s['columns']:.3f}  answer right {s['answer']:.3f}  both {s['both']:.3f}  "
            f"answer|columns {s['answer_given_columns']:.3f}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
