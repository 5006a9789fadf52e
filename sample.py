"""
Run a trained model on one example of its task and print its answers beside the truth.

    python sample.py                          # a fresh test example of the run in out/
    python sample.py --prompt "5 9 1 0 ..."   # your own input (toy: ids; boxes: the prompt text)
    python sample.py --out_dir out-parity --length 300   # a regular language, past training
    python sample.py --out_dir out-text --prompt "The assert statement"   # text: a continuation

A task scored on generated answers ("generation" in task.needs) gets the prompt and the model
writes greedily. Any other sequence is read as a decoder reads it: the prompt at once, then one
token at a time against the cache (a model without one reads it in one pass).
"""

import argparse
import inspect
import os
import time

import torch

from data import task_from_settings
from train import (DEVICE_HELP, DEVICES, OneLineErrors, load_model, number, pick_device, run,
                   synchronize)


@torch.no_grad()
def read(model, x, n_prompt, use_cache):
    """The model's argmax at every position of x (B, T): the prompt x[:, :n_prompt] in one pass,
    then one token at a time. Returns (predictions (B, T), seconds after the prompt)."""
    caches = model.new_caches() if use_cache else None
    predictions = [model(x[:, :n_prompt], caches=caches)[0].argmax(dim=-1)]
    synchronize(x.device.type)
    start = time.perf_counter()
    for t in range(n_prompt, x.size(1)):
        logits, _ = model(x[:, t:t + 1] if use_cache else x[:, :t + 1], caches=caches)
        predictions.append(logits[:, -1:].argmax(dim=-1))
    synchronize(x.device.type)
    return torch.cat(predictions, dim=1), time.perf_counter() - start


def main(argv=None):
    parser = OneLineErrors(prog="sample.py", description=__doc__.split("\n\n")[0].strip())
    add = parser.add_argument
    add("--out_dir", default="out", type=os.path.expanduser, help="the run to load")
    add("--best", action="store_true", help="load best.pt (lowest test loss), not ckpt.pt (latest)")
    add("--prompt", help="your own input, as in the task's docstring (default: a test example)")
    add("--seed", type=number(int, 0, 2**63 - 1), default=0, help="which fresh test example")
    add("--length", type=number(int, 1), help="regular languages: the example's length (any)")
    add("--cache", action=argparse.BooleanOptionalAction, default=True, help="use the cache")
    add("--device", default="auto", choices=DEVICES, help=DEVICE_HELP)
    args = parser.parse_args(argv)
    device = pick_device(args.device)
    model, checkpoint = load_model(args.out_dir, device, "best.pt" if args.best else "ckpt.pt")
    task, config = task_from_settings(checkpoint["args"]), model.config
    if args.length is not None and "length" not in inspect.signature(task.sample).parameters:
        raise ValueError(f"--length: task {checkpoint['args']['task']} has sequences of one length")
    if args.prompt is not None:  # all of it is the prompt
        x = task.encode(args.prompt)[None]
        n_prompt = x.size(1)
    else:  # the prompt: the tokens before the first scored one, unless the task says
        length = {} if args.length is None else {"length": args.length}
        x, y = task.sample(1, torch.Generator().manual_seed(args.seed), split="test", **length)
        n_prompt = task.prompt_length or int((y[0] != -1).nonzero()[0]) + 1
    generating = "generation" in task.needs
    if x.size(1) == 0:
        raise ValueError("--prompt: no tokens")
    truth = None if generating else task.solve(x)  # the solver refuses a sequence not of the task
    use_cache = args.cache and "cache" in config.abilities()
    x = x[:, :n_prompt] if generating else x  # a writing task's model is given its prompt only
    print(f"{checkpoint['args']['task']}, {config.describe()}, step {checkpoint['step']}:")
    x = x.to(device)
    if generating:
        synchronize(device)
        start = time.perf_counter()
        out = task.generate(model, x, config.block_size - x.size(1), use_cache)
        synchronize(device)
        seconds, n_tokens = time.perf_counter() - start, out.size(1) - x.size(1)
        print(task.describe(out[0].cpu()))
        how = "written after the prompt, its one pass included"
    else:
        n_prompt = n_prompt if "cache" in config.abilities() else x.size(1)  # else one pass
        predictions, seconds = read(model, x, n_prompt, use_cache)
        predictions, n_tokens = predictions.cpu(), x.size(1) - n_prompt
        scored = truth != -1
        print(task.describe(x[0].cpu(), truth[0], predictions[0]))
        if scored.any():
            print(f"accuracy {(predictions[scored] == truth[scored]).float().mean().item():.2%}")
        how = f"read one at a time after the {n_prompt}-token prompt"
    if n_tokens:
        path = "with the cache" if use_cache else "no cache, recomputing the prefix"
        print(f"{n_tokens} tokens {how}: {n_tokens / seconds:.0f} tokens/s on {device} ({path})")
    else:
        print(f"{x.size(1)} tokens read in one pass")


if __name__ == "__main__":
    run(main)
