"""
Run a trained model on one example and print its answers beside the truth.

    python sample.py                          # a fresh example of the task the run in out/ learned
    python sample.py --prompt "5 9 1 0 ..."   # toy: your own sequence, values then pointer blocks
    python sample.py --prompt "The cup is in Box B, there is nothing in Box A. Move ..."   # boxes
    python sample.py --no_cache               # recompute the whole prefix for every token (slow path)
    python sample.py --out_dir out-parity --length 300   # a regular language, past its training lengths

Toy task: the model reads the sequence one token at a time, as a decoder would; the first block
is the prompt, encoded at once (for ChaCAL, one triangular solve), then every further token is one
step against the per-layer cache, and the model's prediction at each position is its answer there.
Boxes: the model writes the answer after the prompt by greedy decoding, scored by exact match.
Both paths print the same answers with and without the cache; only the tokens/s differ.
The regular languages and LEGO, and any bidirectional model, are read in one forward pass of a
fresh example; a model that cannot decode against a cache (adaptive depth, LEGO attention)
decodes without one.
"""

import argparse
import os
import time

import torch

from data import BOS, EOS, SEP, decode, encode, render_answer, simulate, until_eos
from train import OneLineErrors, load_model, make_task, pick_device, synchronize


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
    synchronize(x.device.type)
    start = time.perf_counter()
    for t in range(prompt_len, T):
        if use_cache:
            logits, _ = model(x[:, t:t + 1], caches=caches)
        else:
            logits, _ = model(x[:, :t + 1])
        predictions.append(logits[:, -1:].argmax(dim=-1))
    synchronize(x.device.type)
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
    use_cache = not args.no_cache and model.can_cache()
    synchronize(device)
    start = time.perf_counter()
    out = model.generate(prompt[None].to(device), room, temperature=0, use_cache=use_cache,
                         stop_token=EOS)[0, len(prompt):].tolist()
    synchronize(device)
    seconds = time.perf_counter() - start  # the prompt's one pass included
    answer = decode(until_eos(out))
    exact, boxes = task.score_answer(prompt, answer)  # scored as train.py scores its test set
    print(f"prompt: {prompt_text}\nmodel : {answer}\ntruth : {truth}")
    print(f"exact match: {'yes' if exact else 'no'}; boxes right {sum(r for _, r in boxes)}/"
          f"{len(boxes)}; {speed(len(out), seconds, device, not use_cache)}, prompt included")


def main(argv=None):
    parser = OneLineErrors(prog="sample.py", description=__doc__.split("\n\n")[0].strip(),
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out_dir", default="out", help="the run whose ckpt.pt to load")
    parser.add_argument("--prompt", default=None,
                        help="toy: a whole sequence as space- or comma-separated token ids; "
                             "boxes: the prompt text; default: a fresh example drawn with --seed")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fresh example")
    parser.add_argument("--length", type=int, default=None,
                        help="regular languages: length of the fresh example (default: a "
                             "training length drawn with --seed); longer tests extrapolation")
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
    model, checkpoint = load_model(args.out_dir, device)
    run = argparse.Namespace(**checkpoint["args"])
    task = make_task(run, split="test")

    if args.length is not None and not hasattr(task, "test_lengths"):
        parser.error(f"--length: the run in {args.out_dir} learned {run.task}, whose sequences "
                     f"have one length; --length is for the regular languages")
    if args.length is not None and args.length < 1:
        parser.error(f"--length {args.length} must be at least 1")
    learned_positions = model.config.pos == "learned"
    if args.length is not None and learned_positions and args.length > model.config.block_size:
        parser.error(f"--length {args.length}: this model has learned positions up to "
                     f"{model.config.block_size}; a model trained with --pos none runs at any length")
    if run.task == "boxes":
        return answer_boxes(model, task, args, device, parser)
    decodes = run.task == "toy" and model.config.causal  # read one token at a time
    if args.prompt is not None and run.task != "toy":
        parser.error(f"--prompt: typed prompts are for toy and boxes; for {run.task}, sample.py "
                     f"draws a fresh example (choose it with --seed)")
    if args.no_cache and not decodes:
        parser.error(f"--no_cache: this {run.task} model reads its input in one forward pass, "
                     f"with no cache to skip")
    generator = torch.Generator().manual_seed(args.seed)
    if args.length is not None:
        x, _ = task.sample(1, generator, length=args.length)
    elif args.prompt is None:
        x, _ = task.sample(1, generator)
    else:
        words = args.prompt.replace(",", " ").split()
        not_ids = [word for word in words if not word.isdigit()]
        if not_ids:
            parser.error(f"--prompt: a toy prompt is token ids, whole numbers; {not_ids[0]!r} is "
                         f"not one (run without --prompt to see a fresh example)")
        x = torch.tensor([[int(word) for word in words]])
        try:
            task.validate(x)
        except ValueError as error:
            parser.error(f"--prompt: {error}")
    y = task.solve(x)

    depth = "adaptive depth" if model.config.adaptive_depth else f"{model.config.n_layer} x"
    print(f"{run.task}, {depth} {model.config.attn}, step {checkpoint['step']}:")
    if decodes:
        prompt_len = task.block_len
        use_cache = not args.no_cache and model.can_cache()
        predictions, seconds = predict_token_by_token(model, x.to(device), prompt_len, use_cache)
        how = (f"after a {prompt_len}-token prompt; "
               f"{speed(x.size(1) - prompt_len, seconds, device, not use_cache)}")
    else:
        logits, _ = model(x.to(device))
        predictions, how = logits.argmax(dim=-1), "read in one forward pass"
    predictions = predictions.cpu()
    scored = y != -1
    accuracy = (predictions[scored] == y[scored]).float().mean().item()
    print(task.describe(x[0], y[0], predictions[0]))
    print(f"accuracy {accuracy:.2%} {how}")


if __name__ == "__main__":
    main()
