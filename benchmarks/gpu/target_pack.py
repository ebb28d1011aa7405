"""Pack a target model folder into a few small compressed parts, and unpack it again: how the target's weights
reach a machine that can only be sent small files (the lent GPU machine takes 64 MiB a call) for training there.

    python benchmarks/gpu/target_pack.py pack OUT --target smollm2-135m-instruct --feature-layers 1,8,14,20,27 \\
        --keep-tokens corpus/smollm2-135m-instruct --keep-tokens-of flashdraft/drafts/smollm2-135m-instruct \\
        --part-mb 29.3,43,43,43
    python benchmarks/gpu/target_pack.py unpack OUT TARGET_FOLDER   # on the other machine: a loadable model folder

The weights travel in bfloat16 (what a GPU trains with), each tensor split into its high and low bytes (the high
bytes, sign and exponent, compress to a third) and lzma-compressed as one stream with the config and tokenizer
files, cut into parts of the given sizes (a part per call). Two optional cuts make the stream smaller and leave
training exact:

- `--feature-layers`: the weights of the layers after the last one the draft reads are zeros. Training reads only
  the hidden states of the feature layers, which never depend on later layers.
- `--keep-tokens CORPUS`: the embedding (and tied head) rows of tokens that occur nowhere in the corpus, the drafting
  vocabulary of `--keep-tokens-of DRAFT` and the tokenizer's special tokens are zeros. Training embeds only the
  corpus's tokens and scores only the drafting vocabulary's head rows.

Such a folder is for training drafts only: it does not generate as the target does. `--draft DIR` adds a draft
folder to the stream (its tensors as the target's, its other files as they are), for a run that continues a draft
which cannot travel with the repository (Qwen2.5-Coder-0.5B's is 68 MB, more than a call takes): `unpack
--draft-out DIR` writes it back, every tensor bit for bit. `unpack` checks every part's checksum, so a damaged or
missing part is named rather than loaded.

    python benchmarks/gpu/target_pack.py pack OUT --target qwen2.5-coder-0.5b-instruct \
        --feature-layers 1,6,11,16,21 --keep-tokens corpus/qwen2.5-coder-0.5b-instruct \
        --keep-tokens-of flashdraft/drafts/qwen2.5-coder-0.5b-instruct \
        --draft flashdraft/drafts/qwen2.5-coder-0.5b-instruct --part-mb 45,60,60,60,60,60,60,60,60,60
    python benchmarks/gpu/target_pack.py unpack OUT TARGET_FOLDER --draft-out DRAFT_FOLDER
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from flashdraft.models import TRAINING_ONLY

MANIFEST = "pack.json"
WEIGHTS = "model.safetensors"
LAYER_PREFIX = "model.layers."
DRAFT_PREFIX = "draft:"  # a travelling draft's tensors, in the stream after the target's


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _source_folder(target: str) -> Path:
    folder = Path(target)
    if folder.is_dir():
        return folder
    from flashdraft.models import REGISTRY, prepare

    if target not in REGISTRY:
        raise SystemExit(f"--target {target}: neither a model folder nor a registry name ({', '.join(REGISTRY)})")
    return Path(prepare(target))


def kept_token_ids(corpus: Path, drafts: list[Path], tokenizer_folder: Path, vocab_size: int) -> np.ndarray:
    """[V] bool: the tokens whose embedding rows training can read."""
    from transformers import AutoTokenizer

    from flashdraft.train.corpus import read_corpus

    keep = np.zeros(vocab_size, dtype=bool)
    for record in read_corpus(corpus):
        keep[np.asarray(record.input_ids, dtype=np.int64)] = True
    for draft in drafts:
        config = json.loads((draft / "config.json").read_text())["dflash_config"]
        keep[np.asarray(config.get("draft_vocab_ids") or [], dtype=np.int64)] = True
        keep[config["mask_token_id"]] = True
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    keep[[i for i in tokenizer.all_special_ids if i < vocab_size]] = True
    return keep


def _add_target(args, add) -> tuple[dict[str, str], dict]:
    """The target's tensors through `add` (cut as the options say); returns its text files and what was cut."""
    source = _source_folder(args.target)
    config = json.loads((source / "config.json").read_text())
    state = load_file(source / WEIGHTS)
    num_layers = config["num_hidden_layers"]
    keep_layers = num_layers
    if args.feature_layers:
        keep_layers = max(int(i) for i in args.feature_layers.split(",")) + 1
        if keep_layers > num_layers:
            raise SystemExit(f"--feature-layers reads layer {keep_layers - 1}; the target has {num_layers} layers")
    keep_rows, zeroed_rows = None, 0
    if args.keep_tokens:
        vocab_size = state["model.embed_tokens.weight"].shape[0]
        keep_rows = torch.from_numpy(kept_token_ids(args.keep_tokens, args.keep_tokens_of, source, vocab_size))
    for name in sorted(state):
        tensor = state[name].to(torch.bfloat16)
        if name.startswith(LAYER_PREFIX) and int(name[len(LAYER_PREFIX):].split(".")[0]) >= keep_layers:
            tensor = torch.zeros_like(tensor)
        if keep_rows is not None and name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensor = tensor * keep_rows[:, None].to(tensor.dtype)
            zeroed_rows = int((~keep_rows).sum())
        add(name, tensor)
    files = {path.name: path.read_text() for path in sorted(source.iterdir())
             if path.is_file() and path.suffix in (".json", ".jinja")}  # config, tokenizer, chat template
    return files, {"source": str(source), "layers_kept": keep_layers, "layers": num_layers, "rows_zeroed": zeroed_rows}


def pack(args) -> None:
    if args.target is None and args.draft is None:
        raise SystemExit("nothing to pack: give --target (a registry name or model folder) and/or --draft")
    names, high, low = [], [], []

    def add(name: str, tensor: torch.Tensor) -> None:
        planes = tensor.contiguous().view(torch.int16).numpy().view(np.uint8).reshape(-1, 2)
        low.append(planes[:, 0].tobytes())
        high.append(planes[:, 1].tobytes())
        names.append({"name": name, "shape": list(tensor.shape)})

    files, described = None, None
    if args.target is not None:
        files, described = _add_target(args, add)
    draft_files, draft_metadata = None, None
    if args.draft:
        draft_state, draft_metadata = _draft_tensors(args.draft)
        for name in sorted(draft_state):
            add(DRAFT_PREFIX + name, draft_state[name])
        draft_files = {path.name: path.read_text() for path in sorted(args.draft.iterdir())
                       if path.is_file() and path.name != WEIGHTS}
    header = json.dumps({"target": files, "draft": draft_files}).encode()
    stream = lzma.compress(header + b"".join(high) + b"".join(low), preset=args.preset)

    out = Path(args.folder)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(float(mb) * 1e6) for mb in args.part_mb.split(",")]
    if sum(sizes) < len(stream):
        raise SystemExit(f"the packed weights take {len(stream) / 1e6:.1f} MB, the parts only "
                         f"{sum(sizes) / 1e6:.1f} MB: give more or larger --part-mb")
    parts, start = [], 0
    for number, size in enumerate(sizes):
        if start >= len(stream):
            break
        data = stream[start : start + size]
        (out / f"part-{number:02d}").write_bytes(data)
        parts.append({"file": f"part-{number:02d}", "bytes": len(data), "sha256": _sha256(data)})
        start += size
    manifest = {"tensors": names, "parts": parts, "files_bytes": len(header), "target": described,
                "draft": None if args.draft is None else {"source": str(args.draft), "metadata": draft_metadata}}
    (out / MANIFEST).write_text(json.dumps(manifest) + "\n")
    part_sizes = ", ".join(f"{part['bytes'] / 1e6:.1f}" for part in parts)
    what = []
    if described is not None:
        what.append(f"the target {described['source']}: layers kept {described['layers_kept']} of "
                    f"{described['layers']}, embedding rows zeroed {described['rows_zeroed']}")
    if args.draft is not None:
        what.append(f"the draft {args.draft}")
    print(f"{len(stream) / 1e6:.1f} MB in {len(parts)} parts ({part_sizes} MB); " + "; ".join(what))


def _draft_tensors(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """A draft folder's tensors, which travel as bfloat16 planes: refused unless they are bfloat16 already (a shipped
    draft), so that they arrive bit for bit."""
    from safetensors import safe_open

    path = folder / WEIGHTS
    if not path.is_file():
        raise SystemExit(f"--draft {folder}: no {WEIGHTS} there; give a draft folder (e.g. flashdraft/drafts/TARGET)")
    with safe_open(path, framework="pt") as handle:
        metadata = handle.metadata()
    state = load_file(path)
    other = sorted(name for name, tensor in state.items() if tensor.dtype != torch.bfloat16)
    if other:
        raise SystemExit(f"--draft {folder}: tensors {other[:3]} are not bfloat16; pack a shipped (bfloat16) draft")
    return state, metadata


def unpack(args) -> None:
    folder = Path(args.folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    chunks = []
    for part in manifest["parts"]:
        path = folder / part["file"]
        if not path.is_file():
            raise SystemExit(f"{path} is missing: send every part before unpacking")
        data = path.read_bytes()
        if _sha256(data) != part["sha256"]:
            raise SystemExit(f"{path} does not match its checksum: send it again")
        chunks.append(data)
    described, draft = manifest["target"], manifest["draft"]
    if described is not None and args.target is None:
        raise SystemExit(f"{folder} holds the target {described['source']}: give the folder to write it to")
    if draft is not None and args.draft_out is None:
        raise SystemExit(f"{folder} holds the draft {draft['source']}: give --draft-out DIR to write it")
    stream = lzma.decompress(b"".join(chunks))
    start = manifest["files_bytes"]
    files = json.loads(stream[:start])
    total = sum(int(np.prod(t["shape"])) for t in manifest["tensors"])
    if len(stream) != start + 2 * total:
        raise SystemExit(f"the unpacked stream holds {len(stream)} bytes, the files and tensors need "
                         f"{start + 2 * total}")
    high = np.frombuffer(stream, np.uint8, total, offset=start)
    low = np.frombuffer(stream, np.uint8, total, offset=start + total)
    state, at = {}, 0
    for tensor in manifest["tensors"]:
        count = int(np.prod(tensor["shape"]))
        planes = np.stack([low[at : at + count], high[at : at + count]], axis=1)
        state[tensor["name"]] = torch.from_numpy(planes.copy().view(np.int16)).view(torch.bfloat16).reshape(
            tensor["shape"])
        at += count
    draft_state = {name[len(DRAFT_PREFIX):]: state.pop(name) for name in list(state) if name.startswith(DRAFT_PREFIX)}
    if described is not None:
        _write_folder(Path(args.target), files["target"], state, {"format": "pt"})
        # Loading it skips the check that it predicts text as the target does (it cannot: layers and rows are cut).
        (Path(args.target) / TRAINING_ONLY).write_text(
            f"layers after {described['layers_kept'] - 1} and {described['rows_zeroed']} embedding rows zeroed, by "
            f"benchmarks/gpu/target_pack.py from {described['source']}\n")
        print(f"{args.target}: {len(state)} tensors, layers kept {described['layers_kept']}, "
              f"embedding rows zeroed {described['rows_zeroed']}")
    if draft is not None:
        _write_folder(Path(args.draft_out), files["draft"], draft_state, draft["metadata"])
        print(f"{args.draft_out}: the draft {draft['source']}, {len(draft_state)} tensors")


def _write_folder(folder: Path, files: dict[str, str], state: dict[str, torch.Tensor], metadata) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    save_file(state, folder / WEIGHTS, metadata=metadata)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="write the parts and pack.json into FOLDER")
    p.add_argument("folder")
    p.add_argument("--target", help="registry name or model folder (or none: a draft alone, --draft)")
    p.add_argument("--feature-layers", help="zero the layers after the last of these (comma list)")
    p.add_argument("--keep-tokens", type=Path, help="corpus folder: zero the embedding rows of tokens not in it")
    p.add_argument("--keep-tokens-of", type=Path, action="append", default=[],
                   help="draft folder whose drafting vocabulary and mask token keep their rows (repeatable)")
    p.add_argument("--draft", type=Path, help="a (bfloat16) draft folder to send along, e.g. the draft to continue")
    p.add_argument("--part-mb", default="40,40,40,40,40,40,40", help="sizes of the parts in MB, comma list")
    p.add_argument("--preset", type=int, default=6, help="lzma preset, 0-9")
    p.set_defaults(run=pack)
    u = sub.add_parser("unpack", help="rebuild a model folder from FOLDER's parts")
    u.add_argument("folder")
    u.add_argument("target", nargs="?", help="where to write the target, when the parts hold one")
    u.add_argument("--draft-out", help="where to write the draft, when the parts hold one")
    u.set_defaults(run=unpack)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
