import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
torch.set_num_threads(1)
rows=[json.loads(l) for l in open("data/tasks/gsm8k/test.jsonl")][:200]
for m in sys.argv[1:]:
    tok=AutoTokenizer.from_pretrained(m); model=AutoModelForCausalLM.from_pretrained(m).eval()
    tok.padding_side="left"
    if tok.pad_token is None: tok.pad_token=tok.eos_token
    cols=ans=both=0; n=0
    for i in range(0,len(rows),50):
        b=rows[i:i+50]
        enc=tok([r["prompt"] for r in b],return_tensors="pt",padding=True)
        with torch.no_grad(): out=model.generate(**enc,max_new_tokens=36,do_sample=False,pad_token_id=tok.pad_token_id)
        for r,o in zip(b,out):
            t=tok.decode(o[enc.input_ids.shape[1]:],skip_special_tokens=True)
            gold=r["solution"].split("####")[0].strip(); got=t.split("####")[0].strip()
            c=got==gold; a=t.strip().endswith("#### "+r["answer"]) if "####" in t else False
            a = t.split("####")[-1].strip()==str(r["answer"]).strip() if "####" in t else False
            cols+=c; ans+=a; both+=c and a; n+=1
    print(m, f"columns right {cols/n:.3f}  answer right {ans/n:.3f}  both {both/n:.3f}  answer|columns {both/max(cols,1):.3f}")
