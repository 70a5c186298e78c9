"""How fast the `small` shapes learn the default job's math set, in a plain PyTorch/transformers loop.

A reference for `lazytrain train`'s default job (not a replacement): the same data path (`prepare_default_job`,
`load_sft`, `Loader`, `exact_match`), but the model runs as one ordinary HF forward/backward per micro-batch.

    python benchmarks/math_learnability.py --steps 120 --batch-size 16 --seq-len 80            # padded rows
    python benchmarks/math_learnability.py --steps 120 --batch-size 4 --seq-len 256 --packing  # packed rows

With `--packing` the HF forward gets position_ids but no block mask, so attention crosses packed examples
(an approximation; `lazytrain train`'s executor keeps examples apart).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lazytrain.data.default_job_files import prepare_default_job, read_jsonl
from lazytrain.data.loader import Loader
from lazytrain.data.math import exact_match, generate_answers
from lazytrain.data.sft import load_sft
from lazytrain.data.tokenizer import load_tokenizer

SMALL = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
             num_key_value_heads=2)  # train/build.py's `small` preset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=80)
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--eval-every", type=int, default=40)
    parser.add_argument("--num-eval", type=int, default=50, help="held-out problems scored by exact match")
    args = parser.parse_args()

    job = prepare_default_job(tempfile.mkdtemp(prefix="lazytrain-math-"), shapes=SMALL)
    tok = load_tokenizer(job.model_dir)
    data = load_sft(job.train_file, tok, cutoff_len=args.seq_len, eval_dataset=job.eval_file)
    heldout = read_jsonl(job.eval_file)[:args.num_eval]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(job.model_dir))
    loader = Loader(data.examples, batch_size=args.batch_size, seq_len=args.seq_len, packing=args.packing,
                    pad_token_id=tok.pad_token_id, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.0, 1 - s / args.steps))
    print(f"{data.summary()}; exact match before {exact_match(model, tok, heldout):.2f}", flush=True)
    t0, seen = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        batch = loader.next()
        seen += batch.num_examples
        loss = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                     attention_mask=batch.attention_mask, labels=batch.labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if step % args.eval_every == 0 or step == args.steps:
            score = exact_match(model, tok, heldout)
            print(f"step {step}: loss {loss.item():.3f}, {seen} examples seen, exact match {score:.2f}, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    for row, answer in zip(heldout[:4], generate_answers(model, tok, heldout[:4]), strict=True):
        print(f"  {row['messages'][0]['content']} -> {answer!r}")


if __name__ == "__main__":
    main()
