"""Checks of the teacher_distill channel outside the trainer (run from studies/pilot/ after `run_pilot.sh base`).

    python distill_checks.py align           # the teacher's greedy completion, scored: its top-1 is the token itself
    python distill_checks.py where           # where the reverse KL sits (line results, final answer, other tokens)
    python distill_checks.py fixed 1e-3      # 25 AdamW steps on one fixed batch of student rollouts: the loss falls
    python distill_checks.py onpolicy 1e-3 40   # teacher_only re-implemented: 8 new prompts x 8 samples per step
    python distill_checks.py lines MODEL ...    # on all pilot problems: correct, or the first line that is wrong

Each uses the channel (TeacherDistillChannel, reverse KL over the teacher's top-20, as the pilot's variants) on
the student's own samples (temperature 0.5, 28 new tokens, as train.rollout) scored by the causal_lm scorer.
Outputs are committed beside it as checks/<name>.txt.
"""

from __future__ import annotations

import json
import random
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from composer_plugins.losses.teacher_distill import TeacherDistillChannel, TeacherTopK
from composer_plugins.models.logprobs import completion_hidden, lm_head_weight
from composer_plugins.teachers.scoring import LocalScorer, ScoreRequest

torch.manual_seed(0)
torch.set_num_threads(1)
random.seed(0)
TOK = AutoTokenizer.from_pretrained("models/sft/model")
TOK.padding_side = "left"
PAD = TOK.pad_token_id if TOK.pad_token_id is not None else TOK.eos_token_id
TRAIN = [json.loads(line) for line in open("data/tasks/gsm8k/train.jsonl")]
TEST = [json.loads(line) for line in open("data/tasks/gsm8k/test.jsonl")][:120]
SCORER = LocalScorer("models/teacher/model", topk=20)
SCORER.bind(TOK)


def generate(model, prompts, sample, n=1):
    """Left-padded prompts and their completions (mask up to and including the first eos)."""
    enc = TOK([p for p in prompts for _ in range(n)], return_tensors="pt", padding=True, add_special_tokens=False)
    kw = {"do_sample": True, "temperature": 0.5, "top_k": 0} if sample else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(**enc, **kw, max_new_tokens=28, pad_token_id=PAD, eos_token_id=TOK.eos_token_id)
    c = out[:, enc["input_ids"].shape[1] :]
    m = torch.ones_like(c)
    for i in range(c.shape[0]):
        e = (c[i] == TOK.eos_token_id).nonzero()
        if len(e):
            m[i, int(e[0]) + 1 :] = 0
    return enc["input_ids"], enc["attention_mask"], c, m


def score(p, pm, c, m):
    """The teacher's top-20 on each row's completion tokens, packed as the trainer packs them."""
    reqs = [
        ScoreRequest("", "", tuple(c[i, : int(m[i].sum())].tolist()), tuple(p[i][pm[i].bool()].tolist()))
        for i in range(c.shape[0])
    ]
    return TeacherTopK.from_rows({"teacher": SCORER.score(reqs)}, c.shape[1])


def distill(model, ch, p, pm, c, m, ts, mask=None):
    h = completion_hidden(model, p, pm, c, m)
    inputs = {"teacher_scores": ts, "completion_mask": m if mask is None else mask}
    loss, _ = ch({**inputs, "hidden_states": h, "lm_head_weight": lm_head_weight(model)})
    return loss, h


def accuracy(model) -> float:
    """Greedy accuracy on the first 120 pilot problems."""
    model.eval()
    _, _, c, m = generate(model, [r["prompt"] for r in TEST], False)
    ok = 0
    for i, r in enumerate(TEST):
        text = TOK.decode(c[i, : int(m[i].sum())], skip_special_tokens=True)
        ok += "####" in text and text.split("####")[-1].strip() == r["answer"]
    model.train()
    return ok / len(TEST)


def main() -> None:
    what = sys.argv[1]
    student = AutoModelForCausalLM.from_pretrained("models/sft/model")
    ch = TeacherDistillChannel()
    rows = TRAIN[:32]
    if what == "align":
        teacher = AutoModelForCausalLM.from_pretrained("models/teacher/model").eval()
        p, pm, c, m = generate(teacher, [r["prompt"] for r in rows], False)
        ts = score(p, pm, c, m)
        same = (ts.ids[:, 0, :, 0] == c)[m.bool()].float()
        print(f"teacher top-1 == its own greedy token at {float(same.mean()):.4f} of {int(m.sum())} tokens")
    elif what == "where":
        p, pm, c, m = generate(student, [r["prompt"] for r in rows], True)
        ts = score(p, pm, c, m)
        kind = torch.zeros_like(c)  # 1: the tokens after '=' up to the newline (a line's result), 2: after '####'
        for i in range(c.shape[0]):
            state = 0
            for t in range(int(m[i].sum())):
                s = TOK.decode(c[i, t])
                kind[i, t] = state
                state = 1 if "=" in s else 2 if "####" in s else 0 if "\n" in s else state
        with torch.no_grad():
            h = completion_hidden(student, p, pm, c, m)
            logp = (h @ lm_head_weight(student).T).log_softmax(-1)
        top1 = ts.ids[:, 0, :, 0]
        for k, name in ((0, "other"), (1, "line result"), (2, "final answer")):
            sel = m.bool() & (kind == k)
            loss, _ = distill(student, ch, p, pm, c, m, ts, sel.long())
            dis = int((logp.argmax(-1) != top1)[sel].sum())
            n = int(sel.sum())
            print(
                f"{name:12s} tokens {n:4d}  mean KL {float(loss):.3f}  sum {float(loss) * n:6.1f}"
                f"  student argmax != teacher top-1: {dis}"
            )
        for i, t in ((logp.argmax(-1) != top1) & m.bool()).nonzero().tolist():
            a, b = int(logp[i, t].argmax()), int(top1[i, t])
            print(
                f"  disagreement: student {TOK.decode(a)!r} p={float(logp[i, t, a].exp()):.2f}, teacher "
                f"{TOK.decode(b)!r} p={float(ts.logprobs[i, 0, t, 0].exp()):.2f} (student's p of it "
                f"{float(logp[i, t, b].exp()):.3f})"
            )
    elif what == "fixed":
        lr = float(sys.argv[2])
        p, pm, c, m = generate(student, [r["prompt"] for r in rows], True)
        ts = score(p, pm, c, m)
        opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
        for it in range(25):
            loss, h = distill(student, ch, p, pm, c, m, ts)
            with torch.no_grad():
                agree = (h @ lm_head_weight(student).T).argmax(-1) == ts.ids[:, 0, :, 0]
            opt.zero_grad()
            loss.backward()
            gn = float(torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0))
            opt.step()
            agreed = float(agree[m.bool()].float().mean())
            print(f"step {it} loss {float(loss):.4f} student argmax == teacher top-1 {agreed:.3f} grad norm {gn:.3f}")
    elif what == "onpolicy":
        lr, steps = float(sys.argv[2]), int(sys.argv[3])
        opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))  # 10-step warmup
        print(f"lr {lr}: step 0 greedy accuracy (120 pilot problems) {accuracy(student):.3f}", flush=True)
        for step in range(1, steps + 1):
            p, pm, c, m = generate(student, [r["prompt"] for r in random.sample(TRAIN, 8)], True, 8)
            loss, _ = distill(student, ch, p, pm, c, m, score(p, pm, c, m))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            opt.step()
            sched.step()
            if step % 10 == 0:
                print(f"step {step} loss {float(loss):.3f} greedy accuracy {accuracy(student):.3f}", flush=True)
    elif what == "lines":
        problems = [json.loads(line) for line in open("data/tasks/gsm8k/test.jsonl")]
        for path in ["models/sft/model", "models/teacher/model", *sys.argv[2:]]:
            model = AutoModelForCausalLM.from_pretrained(path).eval()
            enc = TOK([r["prompt"] for r in problems], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                out = model.generate(**enc, do_sample=False, max_new_tokens=28, pad_token_id=PAD)
            counts: dict[str, int] = {}
            for r, o in zip(problems, out, strict=True):
                text = TOK.decode(o[enc["input_ids"].shape[1] :], skip_special_tokens=True)
                got, gold = [x.strip() for x in text.split("\n")], [x.strip() for x in r["solution"].split("\n")]
                if "####" in text and text.split("####")[-1].strip() == r["answer"]:
                    key = "correct"
                else:
                    k = next(i for i in range(len(gold)) if i >= len(got) or got[i] != gold[i])
                    key = f"first wrong line {k + 1}"
                counts[key] = counts.get(key, 0) + 1
            print(path, dict(sorted(counts.items())))
    else:
        raise SystemExit(f"unknown check {what!r}; valid: align, where, fixed, onpolicy, lines")


if __name__ == "__main__":
    main()
