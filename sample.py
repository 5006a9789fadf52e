"""
Run a trained model on one example and print its answers beside the truth.

    python sample.py                          # a fresh example of the task the run in out/ learned
    python sample.py --prompt "5 9 1 0 ..."   # toy: your own sequence, values then pointer blocks
    python sample.py --prompt "The cup is in Box B, there is nothing in Box A. Move ..."   # boxes
    python sample.py --no_cache               # recompute the whole prefix for every token (slow path)

Toy task: the model reads the sequence one token at a time, as a decoder would; the first block
is the prompt, encoded at once (for ChaCAL, one triangular solve), then every further token is one
step against the per-layer cache, and the model's prediction at each position is its answer there.
Boxes: the model writes the answer after the prompt by greedy decoding, scored by exact match.
Both paths print the same answers with and without the cache; only the tokens/s differ.
"""

import argparse
import os
import time

import torch

from data import BOS, EOS, SEP, decode, encode, render_answer, simulate
from model import GPT, GPTConfig
from train import OneLineErrors, make_task, pick_device


@torch.no_grad()
def predict_token_by_token(model, x, prompt_len, use_cache=True):
    """The model's argmax at every position of x (B, T), reading it as a decoder would.

    Returns (predictions (B, T), seconds spent after the prompt). Positions inside the prompt
    are predicted from the one prefill pass.
    """
    B, T = x.size()
    caches = model.new_caches() if use_cache else None
    logits, _ = model(x[:, :prompt_len], caches=caches)
    predictions = [logits.argmax(dim=-1)]
    start = time.perf_counter()
    for t in range(prompt_len, T):
        if use_cache:
            logits, _ = model(x[:, t:t + 1], caches=caches)
        else:
            logits, _ = model(x[:, :t + 1])
        predictions.append(logits[:, -1:].argmax(dim=-1))
    return torch.cat(predictions, dim=1), time.perf_counter() - start


def speed(n_tokens, seconds, device, no_cache):
    path = "no cache, recomputing the prefix" if no_cache else "with the cache"
    return f"{n_tokens} tokens at {n_tokens / seconds:.0f} tokens/s on {device} ({path})"


@torch.no_grad()
def answer_boxes(model, task, args, device, parser):
    """Greedy-decode the answer to a boxes prompt (typed, or row --seed of the test split)."""
    if args.prompt is None:
        prompt, truth = task.prompt_and_answer(args.seed % len(task.rows))
        prompt_text = decode(prompt[1:-1])
    else:
        try:
            prompt = torch.tensor([BOS, *encode(args.prompt), SEP])
            boxes, _ = simulate(args.prompt)
        except ValueError as error:
            parser.error(f"--prompt: {error}")
        prompt_text = args.prompt
        truth = render_answer(boxes, with_empty=task.version == "default")
    room = model.config.block_size - len(prompt)
    if room < 1:
        parser.error(f"--prompt: {len(prompt)} tokens leave no room to answer within block_size "
                     f"{model.config.block_size}")
    start = time.perf_counter()
    out = model.generate(prompt[None].to(device), room, temperature=0,
                         use_cache=not args.no_cache, stop_token=EOS)[0, len(prompt):].tolist()
    seconds = time.perf_counter() - start
    answer = decode(out[:out.index(EOS)] if EOS in out else out)
    exact, boxes = task.score_answer(prompt, answer)  # scored as train.py scores its test set
    print(f"prompt: {prompt_text}\nmodel : {answer}\ntruth : {truth}")
    print(f"exact match: {'yes' if exact else 'no'}; boxes right {sum(r for _, r in boxes)}/"
          f"{len(boxes)}; {speed(len(out), seconds, device, args.no_cache)}")


def main(argv=None):
    parser = OneLineErrors(prog="sample.py", description=__doc__.split("\n\n")[0].strip(),
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out_dir", default="out", help="the run whose ckpt.pt to load")
    parser.add_argument("--prompt", default=None,
                        help="toy: a whole sequence as space- or comma-separated token ids; "
                             "boxes: the prompt text; default: a fresh example drawn with --seed")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fresh example")
    parser.add_argument("--no_cache", action="store_true",
                        help="recompute the whole prefix for every token instead of caching")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                        help="auto picks cuda, then mps, then cpu")
    args = parser.parse_args(argv)

    path = os.path.join(args.out_dir, "ckpt.pt")
    if not os.path.exists(path):
        parser.error(f"--out_dir: no checkpoint at {path}; train one first with train.py")
    try:
        device = pick_device(args.device)
    except ValueError as error:
        parser.error(str(error))
    checkpoint = torch.load(path, map_location=device, weights_only=False)
    run = argparse.Namespace(**checkpoint["args"])
    task = make_task(run, split="test")
    model = GPT(GPTConfig(**checkpoint["config"])).to(device).eval()
    model.load_state_dict(checkpoint["model"])

    if run.task == "boxes":
        return answer_boxes(model, task, args, device, parser)
    if args.prompt is None:
        x, _ = task.sample(1, torch.Generator().manual_seed(args.seed))
    else:
        try:
            tokens = [int(token) for token in args.prompt.replace(",", " ").split()]
            x = torch.tensor([tokens])
            task.validate(x)
        except ValueError as error:
            parser.error(f"--prompt: {error}")
    y = task.solve(x)

    prompt_len = task.block_len
    predictions, seconds = predict_token_by_token(model, x.to(device), prompt_len,
                                                  use_cache=not args.no_cache)
    predictions = predictions.cpu()
    scored = y != -1
    accuracy = (predictions[scored] == y[scored]).float().mean().item()
    print(f"{run.task}, {model.config.n_layer} x {model.config.attn}, step {checkpoint['step']}:")
    print(task.describe(x[0], y[0], predictions[0]))
    n_decoded = x.size(1) - prompt_len
    print(f"accuracy {accuracy:.2%} after a {prompt_len}-token prompt; "
          f"{speed(n_decoded, seconds, device, args.no_cache)}")


if __name__ == "__main__":
    main()
