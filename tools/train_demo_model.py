"""Build, train and check kvscope's bundled demo model (``assets/kvscope-demo``).

No machine that runs kvscope can download weights, so the project ships its own small
Qwen3-architecture model trained on CPython's documentation (see ``demo_corpus.py``).
The three steps can run on different machines: ``prepare`` needs this Python's stdlib and
``tokenizers``; ``train`` needs only the prepared folder (so it can run on a lent GPU);
``evaluate`` checks the saved folder as users will load it.

    python tools/train_demo_model.py prepare --data .devcarry/demo
    python tools/train_demo_model.py train --data .devcarry/demo --out assets/kvscope-demo \\
        --device cuda --seed 0 --steps 800 1600 3200 6400
    python tools/train_demo_model.py evaluate --model assets/kvscope-demo --data .devcarry/demo

``--steps`` takes several schedule lengths: each is trained from the same seed and the one
with the lowest validation loss is saved, so the number of epochs is chosen on held-out
data, not guessed. Test-split perplexity is reported for the saved model only.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_corpus import Document, build_documents  # noqa: E402

EOS = "<|endoftext|>"
SPLITS = ("train", "val", "test")
# Percent of documents (by hash of their body) in the test and validation splits.
TEST_PERCENT = 3
VAL_PERCENT = 2
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def split_of(doc: Document) -> str:
    if doc.is_heldout(TEST_PERCENT):
        return "test"
    return "val" if doc.is_heldout(TEST_PERCENT + VAL_PERCENT) else "train"


# --------------------------------------------------------------------------- prepare


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style pre-tokenizer and decoder) so any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer, out: Path) -> None:
    tokenizer.save_pretrained(out)
    # Name the generic fast class (not transformers 5's "TokenizersBackend") so older
    # transformers releases load the folder too.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def prepare(args: argparse.Namespace) -> None:
    """Corpus -> tokenizer -> one uint16 token stream per split (every document + EOS)."""
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    docs = build_documents()
    by_split: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for doc in docs:
        by_split[split_of(doc)].append(doc)
    tokenizer = train_tokenizer([d.text for d in by_split["train"]], args.vocab_size)
    save_tokenizer(tokenizer, data)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    arrays: dict[str, np.ndarray] = {}
    stats: dict[str, dict[str, int]] = {}
    for split, split_docs in by_split.items():
        ids = tokenizer([d.text for d in split_docs], add_special_tokens=False)["input_ids"]
        lengths = np.array([len(x) + 1 for x in ids], dtype=np.int64)
        arrays[split] = np.fromiter((t for x in ids for t in (*x, eos_id)), dtype=np.uint16)
        arrays[f"{split}_starts"] = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        stats[split] = {"documents": len(split_docs), "tokens": int(lengths.sum())}
    np.savez(data / "corpus.npz", **arrays)
    (data / "test_docs.json").write_text(
        json.dumps([{"header": d.header, "body": d.body} for d in by_split["test"]], indent=0)
    )
    meta = {
        "python": platform.python_version(),
        "vocab_size": len(tokenizer),
        "eos_token_id": eos_id,
        "splits": stats,
    }
    (data / "corpus.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta, indent=2))


# --------------------------------------------------------------------------- train


def make_config(vocab_size: int, eos_id: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def add_residual_dropout(model: torch.nn.Module, p: float) -> None:
    """GPT-2-style dropout on each residual branch, added by hooks so the saved model and
    its config stay a plain Qwen3: the corpus is ~1M tokens, so regularise."""

    def hook(module: torch.nn.Module, _inputs: tuple, output):
        if not module.training:
            return output
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, True), *output[1:])
        return F.dropout(output, p, True)

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(hook)
        layer.mlp.register_forward_hook(hook)


def doc_batches(stream: torch.Tensor, starts: torch.Tensor, batch_docs: int):
    """Yield (inputs, targets, mask) of whole documents, right-padded: a causal model's
    outputs at real positions don't depend on padding after them, so no attention mask."""
    ends = torch.cat([starts[1:], torch.tensor([len(stream)], device=starts.device)])
    order = torch.argsort(ends - starts)
    for i in range(0, len(order), batch_docs):
        idx = order[i : i + batch_docs]
        lens = (ends[idx] - starts[idx]).tolist()
        width = max(lens)
        tokens = torch.zeros(len(lens), width, dtype=torch.long, device=stream.device)
        mask = torch.zeros(len(lens), width - 1, dtype=torch.bool, device=stream.device)
        for row, (s, n) in enumerate(zip(starts[idx].tolist(), lens)):
            tokens[row, :n] = stream[s : s + n]
            mask[row, : n - 1] = True
        yield tokens[:, :-1], tokens[:, 1:], mask


@torch.no_grad()
def document_nll(model: torch.nn.Module, stream: torch.Tensor, starts: torch.Tensor,
                 autocast: bool) -> float:
    """Mean next-token loss over whole held-out documents (EOS included, first token not)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for x, y, mask in doc_batches(stream, starts, batch_docs=128):
        with torch.autocast(stream.device.type, torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x, use_cache=False).logits
        nll = F.cross_entropy(logits.float().transpose(1, 2), y, reduction="none")
        total += nll[mask].sum().item()
        count += int(mask.sum())
    model.train(was_training)
    return total / count


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train_one(args: argparse.Namespace, steps: int, corpus: dict[str, torch.Tensor], config,
              deadline: float) -> dict:
    """One run of ``steps`` steps; returns its best-validation state and its log."""
    from transformers import Qwen3ForCausalLM

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    model = Qwen3ForCausalLM(config).to(device)
    model.train()
    add_residual_dropout(model, args.dropout)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda",
    )
    autocast = device.type == "cuda"
    stream, starts = corpus["train"], corpus["train_starts"]
    starts = starts[starts + args.seq_len + 1 <= len(stream)]
    offsets = torch.arange(args.seq_len + 1, device=device)
    best = {"val_loss": float("inf"), "step": 0, "state": None}
    log: list[dict] = []
    t0 = time.time()
    done = 0
    while done < steps and time.time() < deadline:
        for group in opt.param_groups:
            group["lr"] = lr_at(done, steps, args.lr, args.warmup)
        pick = torch.randint(len(starts), (args.batch_size,), device=device, generator=gen)
        window = stream[starts[pick][:, None] + offsets]
        x, y = window[:, :-1], window[:, 1:]
        with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done += 1
        if done % args.eval_every == 0 or done == steps or time.time() >= deadline:
            val = document_nll(model, corpus["val"], corpus["val_starts"], autocast)
            entry = {"step": done, "lr": round(opt.param_groups[0]["lr"], 6), "train_loss": round(loss.item(), 4),
                     "val_loss": round(val, 4), "seconds": round(time.time() - t0, 1)}
            log.append(entry)
            print(f"[steps={steps}] {entry}", flush=True)
            if val < best["val_loss"]:
                best = {"val_loss": val, "step": done,
                        "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    elapsed = time.time() - t0
    tokens = done * args.batch_size * args.seq_len
    return {
        "steps": steps,
        "completed_steps": done,
        "truncated": done < steps,
        "seconds": round(elapsed, 1),
        "epochs": round(tokens / len(stream), 1),
        "best_val_loss": round(best["val_loss"], 4),
        "best_step": best["step"],
        "log": log,
        "state": best["state"],
        "model": model,
    }


def train(args: argparse.Namespace) -> None:
    """Train each schedule length in ``--steps``, save the one with the lowest val loss."""
    from transformers import GenerationConfig

    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    data = Path(args.data)
    meta = json.loads((data / "corpus.json").read_text())
    device = torch.device(args.device)
    with np.load(data / "corpus.npz") as npz:
        corpus = {k: torch.from_numpy(npz[k].astype(np.int64)).to(device) for k in npz.files}
    config = make_config(meta["vocab_size"], meta["eos_token_id"])
    deadline = time.time() + args.max_minutes * 60
    runs = [train_one(args, steps, corpus, config, deadline) for steps in args.steps]
    chosen = min((r for r in runs if r["state"] is not None), key=lambda r: r["best_val_loss"])
    model = chosen["model"]
    model.load_state_dict(chosen["state"])
    test_loss = document_nll(model, corpus["test"], corpus["test_starts"], device.type == "cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    GenerationConfig(
        bos_token_id=meta["eos_token_id"], eos_token_id=meta["eos_token_id"],
        pad_token_id=meta["eos_token_id"], do_sample=False,
    ).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(data / name, out / name)
    metrics = {
        "seed": args.seed,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "params": sum(p.numel() for p in model.parameters()),
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "dropout": args.dropout,
        "chosen_steps": chosen["steps"],
        "test_loss_autocast": round(test_loss, 4),
        "test_ppl_autocast": round(math.exp(test_loss), 2),
        "runs": [{k: v for k, v in r.items() if k not in ("state", "model")} for r in runs],
    }
    Path(args.metrics or out.parent / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(json.dumps({k: v for k, v in metrics.items() if k != "runs"}, indent=1))
    for r in metrics["runs"]:
        print({k: v for k, v in r.items() if k != "log"})


# --------------------------------------------------------------------------- evaluate


@torch.no_grad()
def evaluate(args: argparse.Namespace) -> None:
    """Test perplexity of the saved (bf16) weights, and greedy answers to test-doc headers:
    how many stop on EOS within ``--max-new-tokens``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    data = Path(args.data)
    with np.load(data / "corpus.npz") as npz:
        stream = torch.from_numpy(npz["test"].astype(np.int64))
        starts = torch.from_numpy(npz["test_starts"])
    test_loss = document_nll(model, stream, starts, autocast=False)
    docs = json.loads((data / "test_docs.json").read_text())
    # Every k-th test document, so the prompts span topics, builtins and modules.
    picked = docs[:: max(1, len(docs) // args.prompts)][: args.prompts]
    stopped, samples = 0, []
    for doc in picked:
        prompt = f"{doc['header']}\n\n"
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        new = out[0, ids.shape[1]:].tolist()
        ended = tokenizer.eos_token_id in new
        stopped += ended
        if ended:
            new = new[: new.index(tokenizer.eos_token_id)]
        samples.append({"prompt": prompt, "completion": tokenizer.decode(new), "eos": ended,
                        "new_tokens": len(new) + ended})
    report = {
        "test_loss": round(test_loss, 4),
        "test_ppl": round(math.exp(test_loss), 2),
        "prompts": len(picked),
        "eos_fraction": round(stopped / len(picked), 3),
        "mean_new_tokens": round(sum(s["new_tokens"] for s in samples) / len(samples), 1),
    }
    print(json.dumps(report, indent=1))
    for s in samples[: args.show]:
        print("-" * 60, f"\n{s['prompt']}\033[1m{s['completion']}\033[0m  [eos={s['eos']}]")
    if args.report:
        Path(args.report).write_text(json.dumps({**report, "samples": samples}, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="build corpus and tokenizer, write token streams")
    p.add_argument("--data", required=True)
    p.add_argument("--vocab-size", type=int, default=4096)
    t = sub.add_parser("train", help="train and save the model folder")
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--metrics", help="where to write metrics.json (default: next to --out)")
    t.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--steps", type=int, nargs="+", default=[800, 1600, 3200, 6400])
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--dropout", type=float, default=0.1)
    t.add_argument("--eval-every", type=int, default=250)
    t.add_argument("--max-minutes", type=float, default=4.3, help="wall-clock guard over all runs")
    e = sub.add_parser("evaluate", help="test perplexity and EOS behaviour of a saved folder")
    e.add_argument("--model", required=True)
    e.add_argument("--data", required=True)
    e.add_argument("--prompts", type=int, default=64)
    e.add_argument("--max-new-tokens", type=int, default=64)
    e.add_argument("--show", type=int, default=6)
    e.add_argument("--report")
    args = parser.parse_args()
    {"prepare": prepare, "train": train, "evaluate": evaluate}[args.cmd](args)


if __name__ == "__main__":
    main()
