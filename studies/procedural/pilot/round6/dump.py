"""Greedy completions of two models on the pilot problems; print rows where A is right and B wrong."""
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

def gen(model_dir, rows):
    tok = AutoTokenizer.from_pretrained(model_dir); tok.padding_side = "left"
    if tok.pad_token is None: tok.pad_token = tok.eos_token
    m = AutoModelForCausalLM.from_pretrained(model_dir).eval(); outs = []
    for i in range(0, len(rows), 50):
        ch = rows[i:i+50]; enc = tok([r["prompt"] for r in ch], return_tensors="pt", padding=True)
        with torch.no_grad():
            o = m.generate(**enc, max_new_tokens=60, do_sample=False, pad_token_id=tok.pad_token_id)
        outs += [tok.decode(x[enc.input_ids.shape[1]:], skip_special_tokens=True) for x in o]
    return outs

torch.set_num_threads(1)
rows = [json.loads(l) for l in open("data/tasks/gsm8k/test.jsonl")][:200]
a, b = gen(sys.argv[1], rows), gen(sys.argv[2], rows)
ok = lambda t, r: "####" in t and t.split("####")[-1].strip() == str(r["answer"]).strip()
n = 0
for r, x, y in zip(rows, a, b):
    if ok(x, r) and not ok(y, r) and n < int(sys.argv[3] if len(sys.argv) > 3 else 8):
        n += 1; print("PROMPT", r["prompt"][-60:].replace("\n", " | ")); print(" A:", x.replace("\n", " | ")); print(" B:", y.replace("\n", " | "))
print("A right", sum(ok(x, r) for r, x in zip(rows, a)), "B right", sum(ok(y, r) for r, y in zip(rows, b)))
