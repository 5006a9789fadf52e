"""
Run a trained model on one example of its task and print its answers beside the truth.

    python sample.py                          # a fresh test example of the run in out/
    python sample.py --prompt "5 9 1 0 ..."   # your own input (toy: token ids; boxes: the prompt text)
    python sample.py --no-cache               # recompute the whole prefix for every token (slow path)
    python sample.py --out_dir out-parity --length 300   # a regular language, past its training lengths
    python sample.py --out_dir out-text --prompt "The assert statement"   # text: a continuation

The task decides what the model does with the example. Most tasks give a sequence that the model
reads as a decoder would: a prompt at once (for ChaCAL, a triangular solve; on a CPU, from 128
tokens, in blocks of rows), then one token at a time against the per-layer cache, its prediction
at each position being its answer there. A task that generates_answer (data.Task) gives a
prompt, after which the model writes greedily. The cache changes only the speed. A bidirectional
model, or one that cannot keep a cache (adaptive depth, LEGO attention), reads the whole sequence
in one pass, as training evaluates it: under adaptive depth a shorter prefix would run through
fewer layers.
"""

import argparse
import os
import signal
import time

if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C while torch loads: stop, no traceback
import torch

from data import task_from_settings
from train import (DEVICE_HELP, DEVICES, OneLineErrors, check_seed, load_model, pick_device,
                   run_command, synchronize)


@torch.no_grad()
def read_token_by_token(model, x, n_prompt, use_cache=True):
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
    parser.add_argument("--out_dir", default="out", type=os.path.expanduser,
                        help="the run whose ckpt.pt to load")
    parser.add_argument("--prompt", default=None, help="your own input, in the words of the "
                        "task's docstring (toy: token ids); default: a fresh test example")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fresh example")
    parser.add_argument("--length", type=int, default=None, help="regular languages: length of "
                        "the fresh example (default: a training length); longer tests extrapolation")
    parser.add_argument("--cache", action=argparse.BooleanOptionalAction, default=True,
                        help="read each new token with the cache (--no-cache: recompute the whole "
                        "prefix for every token)")
    parser.add_argument("--device", default="auto", choices=DEVICES, help=DEVICE_HELP)
    args = parser.parse_args(argv)
    try:
        check_seed(args.seed)
        device = pick_device(args.device)
        model, checkpoint = load_model(args.out_dir, device)
        run = checkpoint["args"]
        try:
            task = task_from_settings(run)
        except ValueError as error:  # its data moved, say: the flag is the run's, not sample.py's
            raise ValueError(f"the run in {args.out_dir} cannot rebuild its task from the settings "
                             f"it was trained with ({error}); restore what they name") from None
        x, n_prompt = task.example(torch.Generator().manual_seed(args.seed), args.prompt, args.length)
        task.decode(x[0, :1].cpu())  # a task that cannot write its tokens out (GPT-2 ids with no
        # tokenizer) says so here, before the model runs, rather than in a traceback after it
        flag = ("--prompt" if args.prompt is not None else "--length" if args.length is not None
                else "the run's test example")
        # A model that writes its answer stops at block_size, positions learned or not.
        if not task.generates_answer:
            fix = "a model trained with --pos none runs at any length"
        elif model.config.block_size < 2:
            fix = "this model cannot continue any prompt: it reads one token at most"
        else:  # a writing task takes no --length (Task.example refuses it)
            fix = "shorten it" if args.prompt is not None else "give a --prompt shorter than that"
        if model.config.pos == "learned" and x.size(1) > model.config.block_size:
            raise ValueError(f"{flag}: {x.size(1)} tokens, and this model has learned positions "
                             f"up to {model.config.block_size}; {fix}")
        room = model.config.block_size - x.size(1)
        if task.generates_answer and room < 1:
            tokens = "1 token leaves" if x.size(1) == 1 else f"{x.size(1)} tokens leave"
            raise ValueError(f"{flag}: {tokens} no room to answer within block_size "
                             f"{model.config.block_size}; {fix}")
    except ValueError as error:
        parser.error(str(error))
    use_cache = args.cache and model.can_cache()
    print(f"{run['task']}, {model.config.describe()}, step {checkpoint['step']}:")
    x = x.to(device)
    if task.generates_answer:
        synchronize(device)
        start = time.perf_counter()
        out = task.generate(model, x, room, use_cache)  # greedy, the task's masks if any
        synchronize(device)
        seconds, n_tokens = time.perf_counter() - start, out.size(1) - x.size(1)
        print(task.describe(out[0].cpu()))
        how = "written after the prompt, its one pass included"
    else:
        if not model.can_cache():
            n_prompt = x.size(1)  # everything at once, each position at the depth evaluation used
        predictions, seconds = read_token_by_token(model, x, n_prompt, use_cache)
        truth, predictions, n_tokens = task.solve(x.cpu()), predictions.cpu(), x.size(1) - n_prompt
        scored = truth != -1
        print(task.describe(x[0].cpu(), truth[0], predictions[0]))
        print(f"accuracy {(predictions[scored] == truth[scored]).float().mean().item():.2%}")
        how = f"read one at a time after the {n_prompt}-token prompt"
    if n_tokens:
        path = "with the cache" if use_cache else "no cache, recomputing the prefix"
        counted = "1 token" if n_tokens == 1 else f"{n_tokens} tokens"
        print(f"{counted} {how}: {n_tokens / seconds:.0f} tokens/s on {device} ({path})")
    elif not task.generates_answer:
        print(f"{x.size(1)} tokens read in one pass")


if __name__ == "__main__":
    run_command(main, "interrupted; sample.py changes nothing of the run (a data cache it was "
                      "rebuilding is written whole or not at all), so nothing is lost")
