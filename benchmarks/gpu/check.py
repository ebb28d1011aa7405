"""The GPU check: flashdraft's CUDA path proven in one prepared run.

    python benchmarks/gpu/check.py --out DIR             # on a GPU machine (benchmarks/gpu/README.md says how)
    python benchmarks/gpu/check.py --smoke --out DIR     # every stage on CPU with tiny shapes (CI runs this)

Every model is built from a config with seeded random weights, so nothing but the repository (and a few wheels)
has to travel. Stages, in order:

  greedy-float32   the randomized greedy cases of the core tests (three architectures, block sizes 1-16, an
                   oracle with chosen rejections, stop tokens inside blocks): zero mismatches expected
  greedy-bfloat16  the same kind of cases in bfloat16: match rate and first divergences against the target's own
                   bfloat16 greedy decoding, beside the numerical floor (how often the target's own greedy token
                   changes between one-token steps and one multi-token forward over the same sequence)
  sampling         the sampling path's chi-square test against the target's exact distribution
                   (tests/test_decoding_sampling.py), with its negative control (a biased acceptance rule that must
                   fail)
  speed-*          per target shape (SmolLM2-135M with a 2-layer draft, Qwen3-8B in bfloat16 with a 5-layer
                   draft): plain `generate`, flashdraft at block 1, and flashdraft, the reference (`dflash==0.1.0`)
                   and transformers' DFlash path at block 16 on identical weights, at no acceptance (random draft)
                   and at full acceptance (zeroed final norms: every logit is 0, so every proposal is the argmax
                   token 0, while every forward costs what it always costs); decode tokens/s, the loop's own
                   overhead per round (round time minus the target's and the draft's forwards) and the verify cost
                   curve T(n)/T(1), n = 1..32
  training         `flashdraft train`'s optimizer step on the largest target shape with online features from
                   random tokens: blocks/s and what one epoch of 800k samples would take

JSON (`gpu-check.json`) and Markdown (`gpu-check.md`) are rewritten after every stage, so a run cut short still
returns what it measured. Each stage has a time allowance (cases beyond it are counted as not run); a stage that
fails records its error and the next one runs. Exit status 1 when a correctness stage found a mismatch or failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads: busy-waiting threads stall a shared CPU
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen3Config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the package and the core tests' tiny models and cases

import flashdraft  # noqa: E402
from flashdraft.adaptive import measure_verify_costs  # noqa: E402
from flashdraft.bench.methods import (  # noqa: E402
    DecodeSettings,
    FlashDraft,
    Method,
    Reference,
    TransformersDFlashAssistant,
    TransformersGenerate,
)
from flashdraft.bench.runner import measure  # noqa: E402
from flashdraft.draft import DFlashDraftModel  # noqa: E402
from flashdraft.target import TargetModel, synchronize  # noqa: E402
from flashdraft.train.blocks import TrainingSequence  # noqa: E402
from flashdraft.train.features import OnlineFeatures  # noqa: E402
from flashdraft.train.records import TrainingRecord  # noqa: E402
from flashdraft.train.trainer import TrainConfig, Trainer  # noqa: E402

from tiny import (  # noqa: E402
    ARCHITECTURES,
    OracleProposer,
    chosen_rejections,
    greedy_reference,
    random_case,
    tiny_draft,
    tiny_target,
)

MASK = 1  # the tiny targets' mask token, which they can never produce themselves
EPOCH_SAMPLES = 800_000  # the published recipe's training set size


@dataclass(frozen=True)
class Shape:
    """A target shape for the speed and training stages, with the draft that goes with it."""

    name: str
    config: Callable[[], object]
    draft_layers: int
    dtype: torch.dtype


def qwen3_8b() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def smollm2_135m() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100_000.0}, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def tiny_qwen3() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def tiny_llama() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=384, hidden_size=48, intermediate_size=96, num_hidden_layers=6, num_attention_heads=3,
        num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


@dataclass(frozen=True)
class Plan:
    """How big each stage is: the GPU run and the CPU smoke run differ only here."""

    shapes: tuple[Shape, ...]
    greedy_cases: int  # random-draft cases and oracle cases each (the core tests run 120 of each)
    bf16_cases: int  # per architecture
    sampling_samples: int  # flashdraft's draws for the chi-square test (the core test uses 10,000)
    prompt_tokens: int
    new_tokens: int
    repeats: int  # timed runs per method and acceptance mode (the median is reported)
    curve_max: int
    train_length: int  # tokens per training sequence (a quarter of them prompt)
    train_batch: int
    train_steps: int
    allowance: dict[str, float]  # seconds per stage


GPU_PLAN = Plan(
    shapes=(Shape("smollm2-135m", smollm2_135m, 2, torch.bfloat16), Shape("qwen3-8b", qwen3_8b, 5, torch.bfloat16)),
    greedy_cases=120, bf16_cases=3, sampling_samples=1500, prompt_tokens=128, new_tokens=64, repeats=2,
    curve_max=32, train_length=1024, train_batch=4, train_steps=5,
    allowance={"greedy-float32": 80, "greedy-bfloat16": 45, "sampling": 45, "speed": 120, "training": 30},
)
SMOKE_PLAN = Plan(
    shapes=(Shape("tiny-llama", tiny_llama, 2, torch.float32), Shape("tiny-qwen3", tiny_qwen3, 5, torch.float32)),
    greedy_cases=6, bf16_cases=3, sampling_samples=300, prompt_tokens=16, new_tokens=24, repeats=1,
    curve_max=8, train_length=64, train_batch=2, train_steps=2,
    # Far above what the smoke's cases take (seconds), so that a machine busy with other work still runs them all:
    # its tests require every correctness case.
    allowance={"greedy-float32": 150, "greedy-bfloat16": 60, "sampling": 90, "speed": 40, "training": 20},
)


@dataclass
class Check:
    """The run's settings, its results so far, and the files they are written to."""

    plan: Plan
    device: torch.device
    out: Path
    smoke: bool
    results: dict = field(default_factory=dict)
    targets: dict = field(default_factory=dict)  # shape name -> built target, shared by speed and training

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu-check.json").write_text(json.dumps(self.results, indent=2) + "\n")
        (self.out / "gpu-check.md").write_text(summary(self.results))


def now() -> float:
    return time.perf_counter()


# ---------------------------------------------------------------------------------------------- correctness


def greedy_float32(check: Check, deadline: float) -> dict:
    device = check.device
    targets = {a: tiny_target(a, seed=i, forbid_token=MASK).to(device) for i, a in enumerate(ARCHITECTURES)}
    drafts = {a: tiny_draft(t, block_size=16, mask_token_id=MASK).to(device) for a, t in targets.items()}
    failures, counts = [], {"random-draft": 0, "oracle": 0, "stop": 0}

    def compare(kind: str, case, result: flashdraft.GenerationResult, expected: list[int]) -> None:
        counts[kind] += 1
        if result.tokens != expected or MASK in result.tokens:
            failures.append({"kind": kind, "case": case, "got": result.tokens[:20], "expected": expected[:20]})

    for case in range(check.plan.greedy_cases):  # the core tests' seeds: case and 1000 + case
        if now() > deadline:
            break
        arch = ARCHITECTURES[case % 3]
        target, draft = targets[arch], drafts[arch]
        prompt, max_new, block_size = random_case(random.Random(case))
        result = flashdraft.generate(target, draft, prompt, max_new_tokens=max_new, block_size=block_size)
        compare("random-draft", case, result, greedy_reference(target, prompt, max_new))
        rng = random.Random(1000 + case)
        prompt, max_new, block_size = random_case(rng)
        reference = greedy_reference(target, prompt, max_new)
        oracle = OracleProposer(len(prompt), reference, 96, chosen_rejections(rng, len(prompt), max_new))
        result = flashdraft.generate(target, oracle, prompt, max_new_tokens=max_new, block_size=max(block_size, 2))
        compare("oracle", case, result, reference)

    prompt = [9, 10, 11, 12]
    for arch in ARCHITECTURES:  # a stop token inside an accepted block, as the bonus token, as the first token
        target = targets[arch]
        reference = greedy_reference(target, prompt, 40)
        for block_size in (1, 4, 16):
            for stop_index in (0, 1, 3, 7, 12, 20):
                if now() > deadline:
                    break
                stop = reference[stop_index]
                expected = greedy_reference(target, prompt, 40, stop_token_ids=[stop])
                for wrong_at in (set(), {len(prompt) + len(expected) - 1}):
                    for draft in (OracleProposer(len(prompt), reference, 96, wrong_at), drafts[arch]):
                        result = flashdraft.generate(target, draft, prompt, max_new_tokens=40,
                                                     stop_token_ids=[stop], block_size=block_size)
                        compare("stop", [arch, block_size, stop_index], result, expected)
                        if result.stop_reason != "stop":
                            failures.append({"kind": "stop-reason", "case": [arch, block_size, stop_index]})
    planned = {"random-draft": check.plan.greedy_cases, "oracle": check.plan.greedy_cases, "stop": 3 * 3 * 6 * 4}
    return {"cases": counts, "planned": planned, "mismatches": len(failures), "failures": failures[:10],
            "passed": not failures}


def greedy_bfloat16(check: Check, deadline: float) -> dict:
    device, rows = check.device, []
    for index, arch in enumerate(ARCHITECTURES):
        arch_deadline = now() + (deadline - now()) / (len(ARCHITECTURES) - index)  # an equal share of what is left
        target = tiny_target(arch, seed=index, forbid_token=MASK).to(device, torch.bfloat16)
        draft = tiny_draft(target, block_size=16, mask_token_id=MASK).to(device, torch.bfloat16)
        row = {"arch": arch, "cases": 0, "draft_matches": 0, "oracle_matches": 0, "floor_changed": 0,
               "draft_divergence": [], "oracle_divergence": [], "floor_divergence": []}
        rng = random.Random(7000 + index)
        for _ in range(check.plan.bf16_cases):
            if now() > arch_deadline:
                break
            prompt = [rng.randrange(2, 96) for _ in range(rng.randint(4, 64))]
            block_size, max_new = rng.randint(2, 16), 40
            reference = greedy_reference(target, prompt, max_new)
            runs = {
                "draft": flashdraft.generate(target, draft, prompt, max_new_tokens=max_new, block_size=block_size),
                "oracle": flashdraft.generate(target, OracleProposer(len(prompt), reference, 96), prompt,
                                              max_new_tokens=max_new, block_size=block_size),
            }
            for name, result in runs.items():
                divergence = first_difference(result.tokens, reference)
                row[f"{name}_matches"] += divergence is None
                if divergence is not None:
                    row[f"{name}_divergence"].append(divergence)
            # The floor: the target's own greedy tokens against its argmax in one forward over the whole sequence.
            ids = torch.tensor([prompt + reference], device=device)
            with torch.no_grad():
                argmax = target(ids).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
            divergence = first_difference(argmax, reference)
            row["floor_changed"] += divergence is not None
            if divergence is not None:
                row["floor_divergence"].append(divergence)
            row["cases"] += 1
        rows.append(row)
    return {"rows": rows}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix of the other), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def sampling(check: Check, deadline: float) -> dict:
    import test_decoding_sampling as stats  # the core test's setup, sampler, exact distribution and chi-square test

    samples = check.plan.sampling_samples
    target, draft = stats.target_and_draft()
    target, draft = target.to(check.device), draft.to(check.device)
    reference = stats.exact_distribution(target)
    began = now()
    counts, mean_first_round = stats.flashdraft_samples(target, draft, samples)
    result = {"samples": samples, "p_value": stats.fit_p_value(counts, reference),
              "mean_first_round": mean_first_round, "seconds_per_generation": (now() - began) / samples}
    if now() + (now() - began) < deadline:  # the negative control costs as much again
        import flashdraft.decoding as decoding

        original = decoding.accept_sampled
        decoding.accept_sampled = stats.biased_accept
        try:
            biased, _ = stats.flashdraft_samples(target, draft, samples)
        finally:
            decoding.accept_sampled = original
        result["biased_p_value"] = stats.fit_p_value(biased, reference)
    # The core test asks p > 1e-4 of the exact rule; at fewer samples the biased rule is held to p < 1e-3.
    result["passed"] = result["p_value"] > 1e-4 and result.get("biased_p_value", 0.0) < 1e-3
    return result


# ---------------------------------------------------------------------------------------------- speed


def build_target(shape: Shape, device: torch.device, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: an 8B model initialised on a CPU takes minutes
        model = AutoModelForCausalLM.from_config(shape.config(), dtype=shape.dtype)
    return model.eval()


def build_draft(shape: Shape, target: PreTrainedModel, seed: int = 1) -> DFlashDraftModel:
    torch.manual_seed(seed)
    with torch.device(target.device):
        draft = DFlashDraftModel.for_target(target.config, num_layers=shape.draft_layers, block_size=16,
                                            mask_token_id=target.config.vocab_size - 1)
    return draft.to(shape.dtype).eval()


class ForwardTimer:
    """Synchronised wall time spent inside the forwards of some modules (nested calls counted once)."""

    def __init__(self, modules: dict[str, torch.nn.Module], device: torch.device):
        self.modules, self.device = modules, device
        self.seconds = dict.fromkeys(modules, 0.0)
        self.calls = dict.fromkeys(modules, 0)

    def __enter__(self) -> ForwardTimer:
        self.handles, self.began = [], {}
        for name, module in self.modules.items():
            self.handles.append(module.register_forward_pre_hook(lambda *_, n=name: self._start(n)))
            self.handles.append(module.register_forward_hook(lambda *_, n=name: self._stop(n)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()

    def _start(self, name: str) -> None:
        synchronize(self.device)
        self.began[name] = now()

    def _stop(self, name: str) -> None:
        synchronize(self.device)
        self.seconds[name] += now() - self.began[name]
        self.calls[name] += 1


def speed_methods(target: PreTrainedModel, draft: DFlashDraftModel) -> list[tuple[Method, torch.nn.Module | None]]:
    """Each method with the draft module whose forward it runs (None for plain decoding)."""
    with torch.device(target.device):  # the reference's copy of the draft is built where it runs
        reference = Reference(target, draft)
    assistant = TransformersDFlashAssistant(draft)
    return [
        (TransformersGenerate("ar", target), None),
        (FlashDraft(target, draft, 1), None),
        (FlashDraft(target, draft, 16), draft),
        (reference, reference.draft),
        (TransformersGenerate("transformers-dflash-b16", target, assistant_model=assistant,
                              speculation_type="dflash"), draft),
    ]


def breakdown(method: Method, draft_module, target, prompt, settings: DecodeSettings) -> dict:
    """One run with synchronised timers inside the forwards: where a round's time goes."""
    modules = {"target": target} | ({"draft": draft_module} if draft_module is not None else {})
    with ForwardTimer(modules, target.device) as timer:
        synchronize(target.device)
        began = now()
        method.generate(prompt, settings, 0)
        synchronize(target.device)
        total = now() - began
    rounds = max(timer.calls["target"] - 1, 1)  # forwards after the prefill
    return {
        "rounds": rounds,
        "target_ms_per_round": 1000 * (timer.seconds["target"] / timer.calls["target"]),
        "draft_ms_per_round": 1000 * timer.seconds.get("draft", 0.0) / rounds,
        "overhead_ms_per_round": 1000 * (total - sum(timer.seconds.values())) / rounds,
    }


def time_methods(methods, target, prompt, settings: DecodeSettings, repeats: int, deadline: float) -> dict:
    """Every method `repeats` times, interleaved in an order that rotates each repeat (the machine's drift hits
    all methods alike), then one timed breakdown each. Methods reached after `deadline` are skipped."""
    runs: dict[str, list] = {method.name: [] for method, _ in methods}
    for repeat in range(repeats):
        shift = repeat % len(methods)
        for method, _ in methods[shift:] + methods[:shift]:
            if now() < deadline:
                runs[method.name].append(measure(method, target, prompt, settings, seed=0))
    rows = {}
    for method, draft_module in methods:
        measured = runs[method.name]
        if not measured or now() > deadline:
            rows[method.name] = {"skipped": "time allowance spent"}
            continue
        tokens, lengths = measured[0][0], measured[0][3]
        decode = statistics.median(seconds - first for _, seconds, first, _ in measured)
        rows[method.name] = {
            "tokens": len(tokens),
            "runs": len(measured),
            "decode_tokens_per_s": (len(tokens) - 1) / decode if decode > 0 else 0.0,
            "time_to_first_token_s": statistics.median(first for _, _, first, _ in measured),
            "tau": sum(lengths) / len(lengths) if lengths else 0.0,
            **breakdown(method, draft_module, target, prompt, settings),
            "output": tokens,
        }
    return rows


def speed(check: Check, shape: Shape, deadline: float) -> dict:
    plan, device = check.plan, check.device
    began = now()
    target = check.targets.get(shape.name) or build_target(shape, device)
    check.targets = {shape.name: target}  # one large target in memory at a time
    draft = build_draft(shape, target)
    result = {"shape": shape.name, "dtype": str(shape.dtype).removeprefix("torch."),
              "draft_layers": shape.draft_layers, "build_seconds": now() - began, "modes": {}}
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.config.vocab_size - 1, (1, plan.prompt_tokens), generator=generator)
    prompt = prompt.to(device)
    settings = DecodeSettings(plan.new_tokens, 0.0, ())
    methods = speed_methods(target, draft)
    for method, _ in methods:  # warm-up: kernels chosen, caches allocated
        method.generate(prompt, DecodeSettings(8, 0.0, ()), 0)

    curve_reserve = 0.1 * (deadline - now())
    for number, mode in enumerate(("none", "full")):
        mode_deadline = now() + (deadline - curve_reserve - now()) / (2 - number)  # half of what is left each
        if mode == "full":  # every logit 0: the argmax is token 0 for the target and the draft alike
            with torch.no_grad():
                target.model.norm.weight.zero_()
                draft.norm.weight.zero_()
                methods[3][1].norm.weight.zero_()  # the reference's own copy of the draft
        rows = time_methods(methods, target, prompt, settings, plan.repeats, mode_deadline)
        baseline = rows.get("ar", {}).get("output")
        for row in rows.values():
            if "output" in row:
                row["same_as_ar"] = row.pop("output") == baseline
                if "decode_tokens_per_s" in rows.get("ar", {}):
                    row["speedup_vs_ar"] = row["decode_tokens_per_s"] / rows["ar"]["decode_tokens_per_s"]
        result["modes"][mode] = rows
        check.save()

    if now() < deadline:
        costs = measure_verify_costs(TargetModel(target), plan.curve_max, context_length=plan.prompt_tokens,
                                     every_size=True)
        result["verify_ms"] = {n: 1000 * s for n, s in costs.seconds.items()}
        result["verify_ratio"] = {n: s / costs.seconds[1] for n, s in costs.seconds.items()}
    return result


# ---------------------------------------------------------------------------------------------- training


def training(check: Check, deadline: float) -> dict:
    plan, shape = check.plan, check.plan.shapes[-1]
    target = check.targets.get(shape.name) or build_target(shape, check.device)
    check.targets = {shape.name: target}
    torch.manual_seed(2)
    with torch.device(check.device):
        draft = DFlashDraftModel.for_target(target.config, num_layers=shape.draft_layers, block_size=16,
                                            mask_token_id=target.config.vocab_size - 1)
    generator = torch.Generator().manual_seed(3)
    response_start = plan.train_length // 4
    sequences = []
    for i in range(plan.train_batch * (plan.train_steps + 2)):
        ids = torch.randint(0, target.config.vocab_size - 1, (plan.train_length,), generator=generator).tolist()
        record = TrainingRecord(id=f"random-{i}", source="random", input_ids=ids, response_start=response_start)
        sequences.append(TrainingSequence.from_record(record, max_length=plan.train_length))
    config = TrainConfig(batch_size=plan.train_batch, grad_accum=1, max_steps=plan.train_steps + 2,
                         checkpoint_every=10**6, log_every=10**6)
    features = OnlineFeatures(target, draft.target_layer_ids)
    with tempfile.TemporaryDirectory(prefix="flashdraft-gpu-check-") as folder:
        trainer = Trainer(draft, target, sequences, features, folder, config, progress=False)
        trainer.train_step()  # warm-up
        steps = []
        for _ in range(plan.train_steps + 1):
            if now() > deadline and steps:
                break
            synchronize(check.device)
            steps.append(trainer.train_step())
            synchronize(check.device)
        steps = steps[1:] or steps  # the first timed step still settles allocations
    seconds = sum(s["seconds"] for s in steps)
    blocks = sum(s["blocks"] for s in steps)
    sequences_per_s = len(steps) * plan.train_batch / seconds
    return {
        "shape": shape.name, "draft_layers": shape.draft_layers, "sequence_tokens": plan.train_length,
        "batch_sequences": plan.train_batch, "anchors_per_sequence": config.num_anchors, "steps": len(steps),
        "seconds_per_step": seconds / len(steps), "blocks_per_s": blocks / seconds,
        "sequences_per_s": sequences_per_s, "epoch_hours_800k": EPOCH_SAMPLES / sequences_per_s / 3600,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if check.device.type == "cuda" else None,
        "final_loss": steps[-1]["loss"],
    }


# ---------------------------------------------------------------------------------------------- report


def summary(results: dict) -> str:
    """The Markdown summary of whatever the results hold so far."""
    lines = [f"# GPU check ({'smoke, CPU' if results.get('smoke') else results.get('device_name', '?')})", ""]
    lines.append(f"torch {results.get('torch')}, transformers {results.get('transformers')}, "
                 f"Python {results.get('python')}, {results.get('started')}")
    for name, stage in results.get("stages", {}).items():
        lines += ["", f"## {name}: {stage.get('status')} ({stage.get('seconds', 0):.0f} s)"]
        if stage.get("error"):
            lines += ["", "```", stage["error"].strip()[-1500:], "```"]
        data = stage.get("result") or {}
        if name == "greedy-float32" and data:
            lines.append(f"cases run {data['cases']} of {data['planned']}; mismatches: {data['mismatches']}")
        elif name == "greedy-bfloat16" and data:
            lines += ["", "| arch | cases | flashdraft (random draft) = target | flashdraft (oracle) = target | "
                          "target changes between 1-token and multi-token forwards | first divergences |",
                      "|---|---|---|---|---|---|"]
            for r in data["rows"]:
                lines.append(f"| {r['arch']} | {r['cases']} | {r['draft_matches']} | {r['oracle_matches']} | "
                             f"{r['floor_changed']} | draft {r['draft_divergence']}, oracle {r['oracle_divergence']},"
                             f" floor {r['floor_divergence']} |")
        elif name == "sampling" and data:
            lines.append(f"{data['samples']} samples per side: p = {data['p_value']:.3g} (exact rule, must be > 1e-4)"
                         f", biased rule p = {data.get('biased_p_value', float('nan')):.3g} (must be < 1e-3); "
                         f"{1000 * data['seconds_per_generation']:.1f} ms per generation")
        elif name.startswith("speed") and data:
            lines.append(f"{data['shape']} ({data['dtype']}), draft {data['draft_layers']} layers; "
                         f"built in {data['build_seconds']:.1f} s")
            for mode, rows in data.get("modes", {}).items():
                lines += ["", f"acceptance: {mode}", "",
                          "| method | decode tok/s | x ar | tau | ms target/round | ms draft/round | "
                          "ms overhead/round | same tokens as ar |", "|---|---|---|---|---|---|---|---|"]
                for method, r in rows.items():
                    if "skipped" in r:
                        lines.append(f"| {method} | skipped: {r['skipped']} |||||||")
                        continue
                    lines.append(f"| {method} | {r['decode_tokens_per_s']:.1f} | {r.get('speedup_vs_ar', 0):.2f} | "
                                 f"{r['tau']:.2f} | {r['target_ms_per_round']:.2f} | {r['draft_ms_per_round']:.2f} | "
                                 f"{r['overhead_ms_per_round']:.2f} | {r['same_as_ar']} |")
            if "verify_ratio" in data:
                ratios = ", ".join(f"{n}: {v:.2f}" for n, v in data["verify_ratio"].items())
                lines += ["", f"T(1) = {data['verify_ms'][1]:.2f} ms; T(n)/T(1): {ratios}"]
        elif name == "training" and data:
            lines.append(f"{data['shape']}, {data['draft_layers']}-layer draft, {data['batch_sequences']} x "
                         f"{data['sequence_tokens']} tokens, {data['anchors_per_sequence']} anchors per sequence: "
                         f"{data['seconds_per_step']:.3f} s/step, {data['blocks_per_s']:.0f} blocks/s, "
                         f"{data['sequences_per_s']:.1f} sequences/s; one epoch of 800k samples: "
                         f"{data['epoch_hours_800k']:.1f} h")
    return "\n".join(lines) + "\n"


def run_stage(check: Check, name: str, function, allowance: float, *args) -> None:
    stages = check.results.setdefault("stages", {})
    print(f"[gpu-check] {name} (allowance {allowance:.0f} s)", flush=True)
    began = now()
    try:
        stages[name] = {"status": "running"}
        result = function(check, *args, began + allowance)
        failed = result.get("passed") is False
        stages[name] = {"status": "failed" if failed else "ok", "result": result}
    except Exception:  # noqa: BLE001 - a stage's failure is a finding; the next stage still runs
        stages[name] = {"status": "error", "error": traceback.format_exc()}
        print(traceback.format_exc(), flush=True)
    stages[name]["seconds"] = now() - began
    print(f"[gpu-check] {name}: {stages[name]['status']} in {stages[name]['seconds']:.1f} s", flush=True)
    check.save()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu-check.json and gpu-check.md")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, every stage (about a minute)")
    parser.add_argument("--stages", default="greedy-float32,speed,training,greedy-bfloat16,sampling",
                        help="stages to run, comma separated, in this order (default: all)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU machine, or pass --smoke for the CPU smoke run")
    device = torch.device("cpu" if args.smoke else "cuda")
    plan = SMOKE_PLAN if args.smoke else GPU_PLAN
    import transformers

    check = Check(plan, device, args.out, args.smoke, results={
        "smoke": args.smoke, "device": str(device),
        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "stages": {},
    })
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 stays float32: the exactness stage needs it
    known = {"greedy-float32", "greedy-bfloat16", "sampling", "speed", "training"}
    stages = [s for s in args.stages.split(",") if s]
    if set(stages) - known:
        unknown = ", ".join(sorted(set(stages) - known))
        parser.error(f"unknown stage(s) {unknown}: choose from {', '.join(sorted(known))}")
    for stage in stages:
        allowance = plan.allowance[stage]
        if stage == "speed":
            for shape in plan.shapes:
                run_stage(check, f"speed-{shape.name}", speed, allowance, shape)
        else:
            run_stage(check, stage, {"greedy-float32": greedy_float32, "greedy-bfloat16": greedy_bfloat16,
                                     "sampling": sampling, "training": training}[stage], allowance)
    correctness = [check.results["stages"].get(s, {}) for s in ("greedy-float32", "sampling")]
    return 1 if any(s and s["status"] != "ok" for s in correctness) else 0


if __name__ == "__main__":
    sys.exit(main())
