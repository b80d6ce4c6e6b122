"""The mutants of scripts/mutation_check.py: realistic one-line bugs in the core modules.

Each replaces one exact snippet (it must occur exactly once in its module). `tests` overrides the module's
default test files (MODULE_TESTS), fastest first: `pytest -x` stops at the first failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MODULE_TESTS: dict[str, tuple[str, ...]] = {
    "metrics.py": (
        "tests/unit/test_metrics.py",
        "tests/unit/test_metric_accuracy.py",
        "tests/unit/test_gate_rules.py",
        "tests/unit/test_compare.py",
    ),
    "tolerance.py": (
        "tests/unit/test_tolerance.py",
        "tests/unit/test_gate_rules.py",
        "tests/plugin/test_plugin_gate.py",
        "tests/plugin/test_plugin_gate_trust.py",
    ),
    "baseline.py": (
        "tests/unit/test_baseline_validation.py",
        "tests/unit/test_baseline_files.py",
        "tests/unit/test_gate_rules.py",
        "tests/plugin/test_plugin_baselines.py",
        "tests/plugin/test_plugin_files.py",
        "tests/plugin/test_plugin_loss_scale.py",
    ),
    "comparison.py": (
        "tests/unit/test_compare.py",
        "tests/unit/test_run_isolation.py",
        "tests/unit/test_repeats_and_nonfinite.py",
        "tests/unit/test_language_models.py",
        "tests/unit/test_reference.py",
        "tests/unit/test_models_that_work.py",
    ),
    "capture.py": (
        "tests/unit/test_run_isolation.py",
        "tests/unit/test_compare.py",
        "tests/unit/test_repeats_and_nonfinite.py",
        "tests/unit/test_models_that_work.py",
        "tests/unit/test_language_models.py",
    ),
    "batch.py": (
        "tests/unit/test_run_isolation.py",
        "tests/unit/test_compare.py",
        "tests/unit/test_language_models.py",
        "tests/unit/test_models_that_work.py",
    ),
    "model_build.py": (
        "tests/unit/test_model_build.py",
        "tests/unit/test_variants.py",
        "tests/unit/test_models_that_work.py",
        "tests/unit/test_run_isolation.py",
        "tests/unit/test_compare.py",
    ),
    "variants.py": ("tests/unit/test_variants.py", "tests/unit/test_compare.py"),
    "logprobs.py": (
        "tests/unit/test_cross_engine.py",
        "tests/unit/test_vocabulary_chunks.py",
        "tests/unit/test_language_models.py",
        "tests/unit/test_models_that_work.py",
    ),
    "references.py": (
        "tests/unit/test_reference_cache_key.py",
        "tests/unit/test_reference_files.py",
        "tests/unit/test_reference.py",
        "tests/unit/test_run_isolation.py",
    ),
    "session.py": (
        "tests/plugin/test_plugin_gate_trust.py",
        "tests/plugin/test_plugin_files.py",
        "tests/plugin/test_plugin_gate.py",
        "tests/plugin/test_plugin_baselines.py",
        "tests/plugin/test_plugin_options.py",
        "tests/plugin/test_plugin_bad_input.py",
    ),
    "plugin.py": (
        "tests/plugin/test_plugin_files.py",
        "tests/plugin/test_plugin_options.py",
        "tests/plugin/test_plugin_baselines.py",
        "tests/plugin/test_plugin_gate_trust.py",
    ),
    "isolation.py": (
        "tests/unit/test_run_isolation.py",
        "tests/unit/test_compare.py",
        "tests/unit/test_repeats_and_nonfinite.py",
    ),
    "fingerprint.py": (
        "tests/unit/test_reference_cache_key.py",
        "tests/unit/test_reference_files.py",
        "tests/unit/test_reference.py",
    ),
    "sharding.py": ("tests/unit/test_sharded_sums.py",),
    "launcher.py": ("tests/distributed/test_gates.py",),
    "cross_engine.py": (
        "tests/unit/test_cross_engine.py",
        "tests/unit/test_reference_files.py",
        "tests/unit/test_cli_untrusted.py",
    ),
    "cli.py": ("tests/unit/test_cli.py", "tests/unit/test_cli_untrusted.py"),
    "baseline_diff.py": (
        "tests/unit/test_cli_diff_tree.py",
        "tests/unit/test_cli.py",
        "tests/unit/test_cli_untrusted.py",
    ),
}


@dataclass(frozen=True)
class Mutant:
    module: str
    find: str
    replace: str
    why: str
    tests: tuple[str, ...] = ()


def tests_for(mutant: Mutant) -> list[str]:
    """The mutant's test files that exist, in order."""
    chosen = mutant.tests or MODULE_TESTS[Path(mutant.module).name]
    return [t for t in chosen if (ROOT / t).exists()]


def _m(module: str, find: str, replace: str, why: str, *tests: str) -> Mutant:
    return Mutant(f"pytest_precision/{module}", find, replace, why, tuple(tests))


MUTANTS: list[Mutant] = [
    # metrics.py
    _m("metrics.py", "rms_abs = math.sqrt(sdd / n)", "rms_abs = math.sqrt(sdd / max(n - 1, 1))", "rms with n - 1"),
    _m("metrics.py", "bias_abs = sd / n", "bias_abs = abs(sd) / n", "bias loses its sign"),
    _m(
        "metrics.py",
        "var_x = 0.0 if x_constant else",
        "var_x = 0.0 if False else",
        "x_constant flag ignored (constant reference's float64 variance residue)",
    ),
    _m("metrics.py", "cov_xy = var_x + cov_xd", "cov_xy = var_x - cov_xd", "covariance sign"),
    _m("metrics.py", "1.0 + cov_xd / var_x", "1.0 - cov_xd / var_x", "slope sign"),
    _m("metrics.py", "max(var_d - cov_xd * cov_xd / var_x, 0.0)", "max(var_d, 0.0)", "residual without the fit"),
    _m(
        "metrics.py",
        "10.0 * math.log10(sxx_whole / sdd)",
        "20.0 * math.log10(sxx_whole / sdd)",
        "SQNR as an amplitude ratio",
    ),
    _m("metrics.py", "max_rel=_ratio(max_abs, ref_rms)", "max_rel=_ratio(max_abs, rms_abs)", "max_rel denominator"),
    _m("metrics.py", "max(-d_min, d_max) / scale if count", "d_max / scale if count", "max |d| misses negative errors"),
    _m(
        "metrics.py",
        "(x_finite & ~y_finite).sum(dtype=torch.float64),",
        "(~y_finite).sum(dtype=torch.float64),",
        "nonfinite counts positions where the reference is non-finite too",
    ),
    _m(
        "metrics.py",
        "if not all(math.isfinite(v) for v in reference) or not all(math.isfinite(v) for v in error):",
        "if not all(math.isfinite(v) for v in reference):",
        "a variant's NaN/Inf trusted to the fast pass",
    ),
    _m("metrics.py", "y = y / variant_scale", "y = y * variant_scale", "loss scale applied instead of removed"),
    _m(
        "metrics.py",
        "copy=True).div_(variant_scale)",
        "copy=True).mul_(variant_scale)",
        "fast pass: loss scale applied instead of removed",
    ),
    _m(
        "metrics.py",
        "y_constant=y_min == y_max,\n        shift=shift,",
        "y_constant=False,\n        shift=shift,",
        "y_constant flag ignored",
    ),
    _m(
        "metrics.py",
        "(sxx_whole + sxd_whole) / math.sqrt(sxx_whole * syy)",
        "(sxx_whole - sxd_whole) / math.sqrt(sxx_whole * syy)",
        "cosine sign",
    ),
    # metrics.py: the fast pass (float32 blocks, shift and scale)
    _m("metrics.py", "sxd / scale,  # sum", "sxd / (scale * scale),  # sum", "cross sum unscaled twice"),
    _m("metrics.py", "sdd / (scale * scale),", "sdd / scale,", "sum of squares unscaled once"),
    _m(
        "metrics.py", "centred = scaled.sub_(scaled_shift)", "centred = scaled", "reference not centred: var(x) cancels"
    ),
    _m("metrics.py", "_sum(x * d) - shift * sum_d,", "_sum(x * d),", "cross sum not centred"),
    _m(
        "metrics.py",
        "d = torch.sub(unscaled, x).mul_(scale)",
        "d = torch.sub(unscaled, x)",
        "difference not scaled with the reference",
    ),
    _m(
        "metrics.py",
        ".clamp(-MAGNITUDE_LIMIT, MAGNITUDE_LIMIT)",
        ".clamp(-10, 10)",
        "tiny references not scaled up enough",
    ),
    _m(
        "metrics.py",
        "return values.view(-1, BLOCK).sum(1).sum(dtype=torch.float64)",
        "return values.sum(dtype=torch.float32).to(torch.float64)",
        "one float32 sum per chunk: ~1e-7 of its value lost",
    ),
    # tolerance.py
    _m(
        "tolerance.py",
        "_scaled(expected, 1 - tolerance.rtol) - tolerance.atol",
        "_scaled(expected, 1 - tolerance.rtol) + tolerance.atol",
        "atol added for higher-is-better metrics",
    ),
    _m(
        "tolerance.py",
        "return max(magnitude * (1 + tolerance.rtol) + tolerance.atol, magnitude + noise)",
        "return min(magnitude * (1 + tolerance.rtol) + tolerance.atol, magnitude + noise)",
        "noise floor lowers the allowance",
    ),
    _m(
        "tolerance.py",
        "return _magnitude(metric, obtained) > allowed",
        "return _magnitude(metric, obtained) >= allowed",
        "> to >= in the worse-check",
    ),
    _m(
        "tolerance.py",
        "return max((v for v in values if v is not None), default=0.0)",
        "return min((v for v in values if v is not None), default=0.0)",
        "smaller spread of baseline and run",
    ),
    _m("tolerance.py", "return abs(1.0 - value)", "return 1.0 - value", "slope distance without abs"),
    _m(
        "tolerance.py",
        "if record.nonfinite > before.nonfinite:",
        "if record.nonfinite > before.nonfinite + 1:",
        "one more non-finite value tolerated",
    ),
    _m(
        "tolerance.py",
        "return _magnitude(metric, value) > bound",
        "return value > bound",
        "limits on the raw value, not its magnitude",
    ),
    _m("tolerance.py", "return value < bound", "return value <= bound", "higher-is-better limit inclusive"),
    _m(
        "tolerance.py",
        "return obtained > max(expected * (1 + tolerance.rtol) + tolerance.atol, expected + noise)",
        "return obtained > min(expected * (1 + tolerance.rtol) + tolerance.atol, expected + noise)",
        "improvement threshold too low (higher-is-better)",
    ),
    # baseline.py
    _m("baseline.py", 'return "inf" if value > 0 else "-inf"', 'return "inf"', "-inf written as inf"),
    _m(
        "baseline.py",
        '    if value == "-inf":\n        return -math.inf',
        '    if value == "-inf":\n        return math.inf',
        "-inf read as inf",
    ),
    _m("baseline.py", "if version != SCHEMA_VERSION:", "if version is None:", "another schema version accepted"),
    _m(
        "baseline.py",
        'return directory / relative / f"{stem}.{device_key}.json"',
        'return directory / relative / f"{stem}.json"',
        "device key left out of the file name",
    ),
    _m(
        "baseline.py",
        'name = nodeid.split("::", 1)[1] if "::" in nodeid else nodeid',
        'name = nodeid.split("::")[-1]',
        "class name dropped from the stem",
    ),
    # comparison.py
    _m("isolation.py", "torch.default_generator.manual_seed(RUN_SEED)", "pass", "runs not seeded"),
    _m(
        "comparison.py",
        "math.floor(math.log2(FP16_MAX / max_gradient / 4))",
        "math.ceil(math.log2(FP16_MAX / max_gradient / 4))",
        "loss scale rounded up",
    ),
    _m(
        "comparison.py",
        'scaled = runner.backward and variant.dtype == "float16"',
        'scaled = runner.backward and variant.weight_dtype == "float16"',
        "fp16 autocast not loss-scaled",
    ),
    _m(
        "comparison.py",
        "scale = self.scale if kind in GRADIENT_KINDS else 1.0",
        "scale = self.scale",
        "forward tensors unscaled too",
    ),
    _m(
        "comparison.py",
        'return select_positions(tensor, positions.shape, positions.index) if kind in ("fw", "bw") else tensor',
        'return select_positions(tensor, positions.shape, positions.index) if kind == "fw" else tensor',
        "padding not masked out of backward tensors",
    ),
    _m(
        "positions.py",
        "logits_index = valid_index + valid_index // max(positions, 1)",
        "logits_index = valid_index + 1 + valid_index // max(positions, 1)",
        "logits rows shifted by one position",
        "tests/unit/test_language_models.py",
        "tests/unit/test_vocabulary_chunks.py",
        "tests/unit/test_models_that_work.py",
        "tests/unit/test_compare.py",
    ),
    _m(
        "positions.py",
        "if counted.numel() != mask.numel():",
        "if False:",
        "padding counted",
        "tests/unit/test_language_models.py",
        "tests/unit/test_models_that_work.py",
        "tests/unit/test_compare.py",
        "tests/unit/test_host_syncs.py",
    ),
    _m(
        "comparison.py",
        "                reference.numel(),\n                reference_values,",
        "                tensor.numel(),\n                reference_values,",
        "count over the padded positions too",
        "tests/unit/test_compare.py",
    ),
    _m(
        "comparison.py",
        "self.needs_exact = any(error is None for _, error, _ in results)",
        "self.needs_exact = False",
        "no exact pass for a run with NaN/Inf",
    ),
    _m(
        "comparison.py",
        "row_count = 0 if rows is None else int(rows.numel())",
        "row_count = 0 if rows is None else int(rows.numel()) + 1",
        "KL averaged over one position too many",
    ),
    _m(
        "comparison.py",
        "(loss * loss_scale if loss_scale != 1 else loss).backward()",
        "loss.backward()",
        "loss scale never applied",
    ),
    _m(
        "comparison.py",
        "for _ in range(repeats - 1):\n            measured = _VariantPass(runner, ref.variant",
        "for _ in range(repeats - 2):\n            measured = _VariantPass(runner, ref.variant",
        "one reference repeat too few",
    ),
    _m(
        "comparison.py",
        "(max(seen) - min(seen)) + noise.get(key, 0.0)",
        "(max(seen) - min(seen))",
        "reference noise left out of the spread",
    ),
    _m(
        "comparison.py",
        "return all(_version_of(self.stored[key]) == version for key, version in self.versions.items())",
        "return True",
        "in-place writes to kept reference tensors ignored",
    ),
    _m(
        "comparison.py",
        'logprob_dtype=torch.float64 if ref.variant.dtype == "float64" else torch.float32,',
        "logprob_dtype=torch.float32,",
        "fp64 reference's log-probs in float32",
    ),
    # capture.py
    _m("capture.py", 'return name if index == 0 else f"{name}#{index}"', "return name", "repeated calls share a row"),
    _m(
        "capture.py",
        'items: Any = [v for k, v in value.items() if k != "loss"]',
        "items: Any = list(value.values())",
        "the loss taken as a module's output",
    ),
    _m(
        "capture.py",
        "if trace.forward is None and finite_in and not _all_finite(output):",
        "if trace.forward is None and not _all_finite(output):",
        "non-finite origin blamed on a module whose inputs were non-finite",
    ),
    _m("capture.py", "if best is None or size > best[0]:", "if best is None or size < best[0]:", "smallest block list"),
    _m(
        "capture.py",
        "return [name for name in all_names if any(re.fullmatch(p, name) for p in patterns)]",
        "return [name for name in all_names if any(re.search(p, name) for p in patterns)]",
        "module patterns matched by search, not full match",
    ),
    # batch.py
    _m(
        "batch.py",
        "return moved.requires_grad_(value.requires_grad and moved.is_floating_point())",
        "return moved",
        "inputs never require grad",
    ),
    _m("batch.py", "mask = keep if mask is None else mask & keep", "mask = keep", "attention mask dropped with labels"),
    _m("batch.py", "return int(mask.sum())", "return int(mask.numel())", "token count includes padding"),
    # logprobs.py
    _m(
        "logprobs.py",
        "valid = valid & (attention_mask[:, 1:] != 0) & (attention_mask[:, :-1] != 0)",
        "valid = valid & (attention_mask[:, 1:] != 0)",
        "attention mask applied to the target only (left padding)",
    ),
    _m("logprobs.py", "work /= temperature", "work *= temperature", "temperature multiplied"),
    _m(
        "logprobs.py",
        "rows.index_select(0, index + index // max(positions, 1))",
        "rows.index_select(0, index)",
        "chosen log-probs read from the wrong rows when the batch holds several sequences",
    ),
    _m(
        "logprobs.py",
        "low, high = math.log1p(-clip_eps), math.log1p(clip_eps)",
        "low, high = -clip_eps, clip_eps",
        "clip band in ratio space, not log space",
    ),
    _m(
        "logprobs.py",
        "    mean_of_means = means / sequences",
        "    mean_of_means = means / max(sequences - 1, 1)",
        "per-sequence mean over one sequence too few",
    ),
    _m(
        "logprobs.py",
        "    count = valid.sum(dtype=torch.float64)\n    low, high",
        "    count = torch.tensor(float(valid.numel()), dtype=torch.float64)\n    low, high",
        "log-ratio mean over uncounted tokens too",
    ),
    _m(
        "logprobs.py",
        "kl = log_p.exp_().mul_(difference).sum(dim=-1).clamp_min_(0.0)",
        "kl = log_p.exp_().mul_(difference).mean(dim=-1).clamp_min_(0.0)",
        "KL averaged over the vocabulary",
    ),
    # model_build.py
    _m(
        "model_build.py",
        'if dtype == "float16":\n        patterns += list(getattr(model, "_keep_in_fp32_modules", None) or [])',
        'if dtype in ("float16", "bfloat16"):\n        patterns += list(getattr(model, "_keep_in_fp32_modules", None) or [])',
        "_keep_in_fp32_modules applied in bf16",
    ),
    _m(
        "model_build.py",
        'outer = [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]',
        "outer = [n for n in names if not any(n.startswith(o) for o in names if o != n)]",
        "fp32-module prefix matching without the dot",
    ),
    _m(
        "model_build.py",
        "return map_floating(output, lambda t: t.to(input_dtype))",
        "return output",
        "an fp32 module's output not cast back",
    ),
    _m(
        "model_build.py",
        "        cast_parameters(model, variant.weight_dtype)\n        for parameter in model.parameters():\n            parameter.grad = None",
        "        cast_parameters(model, variant.weight_dtype)\n        for parameter in model.parameters():\n            pass",
        "a factory's stale .grad kept",
    ),
    _m(
        "model_build.py",
        "copied = nn.Parameter(data, requires_grad=parameter.requires_grad)",
        "copied = nn.Parameter(data)",
        "frozen parameters trainable in the copy",
    ),
    _m("model_build.py", "keep_output_fp32=name == head", "keep_output_fp32=True", "every fp32 module returns fp32"),
    _m(
        "variants.py",
        'return "float32" if self.autocast else self.dtype',
        "return self.dtype",
        "autocast casts weights",
    ),
    # references.py
    _m(
        "fingerprint.py",
        "weighted = torch.dot(piece, weights[: piece.numel()]) * (1.0 + index * _CHUNK_FACTOR)",
        "weighted = torch.dot(piece, weights[: piece.numel()])",
        "checksum blind to a value moved to the same offset of another chunk",
    ),
    _m(
        "references.py",
        "if entry is not None and any(anchor() is None for anchor in entry[2]):",
        "if False:",
        "a cache entry whose id-named object was freed still served",
    ),
    _m(
        "fingerprint.py",
        "described = (tuple(value.shape), str(value.dtype), str(value.device), bool(value.requires_grad))",
        "described = (tuple(value.shape), str(value.dtype), str(value.device))",
        "an input's requires_grad left out of the cache key",
    ),
    # session.py
    _m(
        "session.py",
        "        if limit_violations:\n            parts.append(messages.limit_message(limit_violations, order))",
        "        if False:\n            parts.append(messages.limit_message(limit_violations, order))",
        "limits ignored in compare mode",
    ),
    _m(
        "session.py",
        "if test in self.collected and (test not in self.checked or file_device != current_device):",
        "if test in self.collected and test not in self.checked:",
        "stale check ignores the device suffix",
    ),
    # --- mutants of the code written for issue 10 ---
    # tolerance.py: undefined metrics, settings
    _m(
        "tolerance.py",
        "if old is None and new is None and undefined_by_reference(record, metric):",
        "if old is None or new is None:",
        "an undefined metric skipped silently",
    ),
    _m(
        "tolerance.py",
        "    if metric in _RELATIVE and record.ref_rms == 0:\n        return True",
        "    if metric in _RELATIVE:\n        return True",
        "every relative metric excused as undefined by its reference",
    ),
    _m("tolerance.py", "if math.isnan(number):", "if number != number and False:", "NaN accepted as a tolerance"),
    _m(
        "tolerance.py",
        "if isinstance(value, bool) or not isinstance(value, Real):",
        "if not isinstance(value, Real):",
        "True accepted as a tolerance of 1",
    ),
    _m(
        "tolerance.py",
        "if minimum is not None and number < minimum:",
        "if minimum is not None and number < minimum - 1:",
        "negative tolerance accepted",
    ),
    _m(
        "tolerance.py",
        "return math.isinf(self.rtol) or math.isinf(self.atol)",
        "return math.isinf(self.rtol) and math.isinf(self.atol)",
        "rtol=inf alone not unbounded",
    ),
    _m(
        "tolerance.py",
        'm != "nonfinite" and defined_value(record, m) is None and not undefined_by_reference(record, m)',
        'm != "nonfinite" and record.metric(m) is None and not undefined_by_reference(record, m)',
        "a NaN metric counted as defined",
    ),
    # baseline.py: validation, names, temporaries, ownership
    _m("baseline.py", 'if ".." in re.split(r"[/\\\\]", stem):', "if False:", "'..' allowed in a baseline name"),
    _m(
        "baseline.py",
        "if size > MAX_STEM_BYTES:",
        "if size > 4 * MAX_STEM_BYTES:",
        "over-long baseline names accepted",
    ),
    _m(
        "baseline.py",
        'if stem.split(".", 1)[0].strip().upper() in RESERVED_NAMES:',
        "if stem.strip().upper() in RESERVED_NAMES:",
        "reserved device names with an extension accepted",
    ),
    _m(
        "baseline.py",
        'if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:\n        return None',
        "if not isinstance(data, dict):\n        return None",
        "a JSON of another schema counted as the plugin's own file",
    ),
    _m(
        "baseline.py",
        'dead = age > DEAD_WRITER_GRACE_SECONDS and not _process_alive(int(match["pid"]))',
        "dead = True",
        "a live writer's temporary file swept away",
    ),
    # session.py and plugin.py: gate, stale files, unasserted runs
    _m(
        "session.py",
        "            if self.is_protected(test):\n                continue",
        "            if False:\n                continue",
        "files of uncollectable modules called stale",
    ),
    _m(
        "session.py",
        "            if data is None:\n                continue",
        '            if data is None:\n                data = {"test": ""}',
        "foreign JSON files called stale",
    ),
    # batch.py, model_build.py, isolation.py, comparison.py: runs isolated
    _m(
        "batch.py",
        "moved = value.detach().to(device=device, dtype=wanted, copy=True)",
        "moved = value.detach().to(device=device, dtype=wanted)",
        "inputs not copied: a forward writing them in place changes the caller's",
    ),
    _m(
        "batch.py",
        'return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)',
        "return tuple(items)",
        "namedtuple inputs lose their type",
    ),
    _m(
        "model_build.py",
        "        if model in self._models:",
        "        if False:",
        "a factory's repeated model accepted",
    ),
    _m(
        "isolation.py",
        "        stack.enter_context(torch.inference_mode(False))\n",
        "",
        "the caller's inference_mode leaks into the runs",
    ),
    _m(
        "isolation.py",
        "                stack.enter_context(torch.autocast(device_type=device_type, enabled=False))",
        "                pass",
        "the caller's autocast leaks into the runs",
    ),
    _m(
        "comparison.py",
        "if not (math.isfinite(low) and math.isfinite(high)):",
        "if not math.isfinite(low):",
        "a reference reaching +inf taken as finite",
    ),
    _m(
        "comparison.py",
        "    if nonfinite:\n        stored.clear()",
        "    if nonfinite and False:\n        stored.clear()",
        "a non-finite reference measured against",
    ),
    # fingerprint.py: the cache key
    _m(
        "fingerprint.py",
        "parts.append((name, id(type(module)), module.training, hooks, attributes))",
        "parts.append((name, id(type(module)), hooks, attributes))",
        "a submodule's training flag left out of the cache key",
    ),
    _m(
        "fingerprint.py",
        "hooks = tuple((hook_dict, tuple(state.get(hook_dict, {}))) for hook_dict in _HOOK_DICTS)",
        "hooks = ()",
        "hooks left out of the cache key",
    ),
    _m(
        "fingerprint.py",
        "requires_grad = tuple(p.requires_grad for p in model.parameters())",
        "requires_grad = ()",
        "requires_grad left out of the cache key",
    ),
    # cli.py and cross_engine.py: diff rules, untrusted files
    _m(
        "baseline_diff.py",
        'lines = [f"dropped variant {variant}" for variant in old.variants if variant not in new.variants]',
        "lines: list[str] = []",
        "diff passes when NEW drops a variant",
    ),
    _m(
        "baseline_diff.py",
        "            if record.nonfinite > previous.nonfinite:",
        "            if record.nonfinite > previous.nonfinite + 1:",
        "diff tolerates one more non-finite value",
    ),
    _m(
        "cross_engine.py",
        'content = content.astype(content.dtype.newbyteorder("="))',
        'content = content.view(content.dtype.newbyteorder("="))',
        "big-endian log-probs reinterpreted instead of converted",
    ),
    _m(
        "sharding.py",
        "        for index in (0, 1, 2, 3, 4, 5, 7):",
        "        for index in (0, 1, 2, 3, 4, 5):",
        "non-finite counts not added across ranks (left as the first rank's)",
    ),
    _m(
        "sharding.py",
        "            total[index] = -largest(-total[index], -values[index])",
        "            total[index] = largest(total[index], values[index])",
        "the minima of the parts combined as maxima",
    ),
    _m(
        "sharding.py",
        "    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)",
        "    return max(a, b)",
        "a NaN maximum on a later rank lost (Python's max is order-dependent with NaN)",
    ),
    _m(
        "sharding.py",
        "            if key in seen:\n                continue",
        "            if False:\n                continue",
        "a replicated plain tensor (row-parallel output) counted once per rank",
        "tests/unit/test_sharded_sums.py",
        "tests/distributed/test_sharded.py",
    ),
    _m(
        "sharding.py",
        "        if part.owned is False:\n            continue",
        "        if part.owned is None:\n            continue",
        "DTensor replicas counted, plain tensors dropped",
        "tests/unit/test_sharded_sums.py",
        "tests/distributed/test_sharded.py",
    ),
    _m(
        "sharding.py",
        "        c == 0 for c, p in zip(coordinate, dtensor.placements, strict=True) if p.is_replicate()",
        "        c == 0 for c, p in zip(coordinate, dtensor.placements, strict=True) if p.is_shard()",
        "DTensor ownership decided on the sharded mesh dimensions instead of the replicated ones",
        "tests/distributed/test_sharded.py",
    ),
    _m(
        "comparison.py",
        "    return averaged.div_(dist.get_world_size())",
        "    return averaged",
        "an unsharded model's gradients summed over the ranks instead of averaged (DDP averages)",
        "tests/distributed/test_sharded.py",
    ),
    _m(
        "comparison.py",
        "            nonfinite = list(dict.fromkeys(kind for kinds, _ in everyone for kind in kinds))",
        "            nonfinite = list(everyone[0][0])",
        "a reference non-finite on rank 1 only accepted by rank 0 (the ranks part ways)",
        "tests/distributed/test_sharded.py",
    ),
    _m(
        "logprobs.py",
        "    variance = max(0.0, mean_squares / sequences - mean_of_means * mean_of_means)",
        "    variance = max(0.0, mean_squares / sequences)",
        "per-sequence std computed without removing the mean",
        "tests/unit/test_sharded_sums.py",
        "tests/unit/test_language_models.py",
    ),
    _m(
        "session.py",
        "        differing = [str(index) for index, (other, _) in enumerate(everyone) if other != everyone[0][0]]",
        "        differing: list[str] = []",
        "ranks holding different reports still get rank 0's verdict",
        "tests/distributed/test_gates.py",
    ),
    _m(
        "launcher.py",
        '    failed = [o for o in outcomes if o["outcome"] == "failed"]',
        '    failed = [o for o in outcomes[:1] if o["outcome"] == "failed"]',
        "a launched test passes when rank 0 passed, whatever the other ranks did",
        "tests/distributed/test_gates.py",
    ),
    _m(
        "session.py",
        "            then = recorded.get(name, DRIFT_DEFAULTS.get(name))",
        "            then = recorded.get(name, current.get(name))",
        "a baseline from before world_size was recorded never warns under several ranks",
        "tests/distributed/test_gates.py",
    ),
    # #13: isolated error
    _m(
        "isolated.py",
        "            replacement = reference.to(device=actual.device, dtype=actual.dtype, copy=True)",
        "            replacement = actual.detach().clone()",
        "an isolated module runs on the variant's own input: isolated error equals propagated error",
        "tests/unit/test_isolated_error.py",
    ),
    _m(
        "isolated.py",
        "            gradients.append(gradient.to(device=output.device, dtype=output.dtype))",
        "            gradients.append(torch.ones_like(output))",
        "isolated backward driven by ones instead of the reference's gradient at the output",
        "tests/unit/test_isolated_error.py",
    ),
    _m(
        "isolated.py",
        "                gradient = gradient.to(torch.float64) * self.scale",
        "                gradient = gradient.to(torch.float64)",
        "fp16 isolated backward not loss-scaled, but unscaled at measurement",
        "tests/unit/test_isolated_error.py",
    ),
    _m(
        "isolated.py",
        '        if not any(".".join(name.split(".")[:i]) in selected for i in range(1, name.count(".") + 1))',
        "        if True",
        "every selected module is a boundary, nested ones too",
        "tests/unit/test_isolated_error.py",
    ),
    _m(
        "isolated.py",
        "in inside - outside}",
        "in inside}",
        "a weight tied to an unselected module gets a grad_isolated row holding part of its gradient",
        "tests/unit/test_isolated_error.py",
    ),
    _m(
        "isolated.py",
        "                return _placed(args, kwargs, slot, alias)",
        "                return None",
        "bw_isolated measured against the whole gradient at the input, residual path included",
        "tests/unit/test_isolated_error.py",
    ),
    _m(
        "comparison.py",
        '            if kind in ("fw", "bw") or (kind == "grad" and name in owned):',
        '            if kind in ("fw", "bw", "grad"):',
        "parameters outside the boundaries get isolated rows",
        "tests/unit/test_isolated_error.py",
    ),
    # #13: arrangements
    _m(
        "arrangements.py",
        '            step = {"input_ids": ids[:, position : position + 1], key: cache, "use_cache": True}',
        '            step = {"input_ids": ids[:, position - 1 : position], key: cache, "use_cache": True}',
        "decode feeds the previous token at each step",
        "tests/unit/test_arrangements.py",
    ),
    _m(
        "arrangements.py",
        "        keep = (row_grid >= 0) & (position_grid >= 0) & (position_grid < self.length)",
        "        keep = (position_grid >= 0) & (position_grid < self.length)",
        "filler rows (-1) are written into the batch's last row",
        "tests/unit/test_arrangements.py",
    ),
    _m(
        "arrangements.py",
        "            offsets += [0, start - (width - own)]",
        "            offsets += [0, start - (width - own) + 1]",
        "left-padded outputs placed one position late",
        "tests/unit/test_arrangements.py",
    ),
    _m(
        "arrangements.py",
        "            positions[2 * row + 1, width - (end - start) :] += start",
        "            pass",
        "a row the reference held left-padded is renumbered from 0",
        "tests/unit/test_arrangements.py",
    ),
    _m(
        "arrangements.py",
        "            missed = needed[~self.covered[needed.to(self.covered.device)]]",
        "            missed = needed[:0]",
        "positions no call computed are compared as zeros",
        "tests/unit/test_arrangements.py",
    ),
    _m(
        "report.py",
        "                self.token_logprobs[sampler].cpu(),",
        "                self.token_logprobs[trainer].cpu(),",
        "the trainer-sampler mismatch compares the trainer with itself",
        "tests/unit/test_arrangements.py",
    ),
    _m(
        "comparison.py",
        '            absent = (LOGITS_KIND,) if variant.arrangement is None else (LOGITS_KIND, "loss", *GRADIENT_KINDS)',
        "            absent = (LOGITS_KIND,)",
        "an arrangement variant reports its (never computed) backward rows as missing",
        "tests/unit/test_arrangements.py",
        "tests/unit/test_compare.py",
    ),
    # 14: diff of folders and git refs; tolerances per metric; update modes; stale files
    _m(
        "baseline_diff.py",
        "            side.add(path.relative_to(root).as_posix(), path)",
        "            side.add(path.name, path)",
        "folders pair baselines by file name instead of relative path",
        "tests/unit/test_cli_diff_tree.py",
    ),
    _m(
        "baseline_diff.py",
        "    return 1 if failed or removed else 0",
        "    return 1 if failed else 0",
        "a removed baseline (a dropped gate) does not fail",
        "tests/unit/test_cli_diff_tree.py",
    ),
    _m(
        "baseline_diff.py",
        "            files.append((name[len(prefix) :] if name.startswith(prefix) else Path(name).name, name, blob))",
        "            files.append((name, name, blob))",
        "--against keeps ls-tree's repository paths, so nothing pairs with PATH's files",
        "tests/unit/test_cli_diff_tree.py",
    ),
    _m(
        "tolerance.py",
        "        tolerance = rules.for_metric(record.name, record.kind, metric)",
        "        tolerance = rules.for_tensor(record.name, record.kind)",
        "per-metric tolerances are ignored by the gate",
        "tests/unit/test_metric_tolerances.py",
    ),
    _m(
        "tolerance.py",
        "                (entry.get(metric) or {}).get(quantity) if metric is not None else None,\n                entry.get(quantity),",
        "                entry.get(quantity),\n                (entry.get(metric) or {}).get(quantity) if metric is not None else None,",
        "a tensor entry's own number beats its per-metric entry",
        "tests/unit/test_metric_tolerances.py",
    ),
    _m(
        "tolerance.py",
        "    return float(higher), {}",
        "    return float(higher), dict(lower[1])",
        "a marker's number leaves the ini's per-metric values in force",
        "tests/unit/test_metric_tolerances.py",
    ),
    _m(
        "session.py",
        '        if self.update and self.update_mode == "failing" and parts:',
        '        if self.update and self.update_mode == "failing":',
        "--precision-update-mode=failing rewrites files within tolerance too",
        "tests/plugin/test_plugin_review_workflow.py",
    ),
    _m(
        "plugin.py",
        "        if stale and not precision_session.prune and (precision_session.fail_stale or precision_session.strict):",
        "        if stale and not precision_session.prune and precision_session.fail_stale:",
        "--precision-strict does not fail on stale baselines",
        "tests/plugin/test_plugin_review_workflow.py",
    ),
    _m(
        "session.py",
        "        ungated = sorted(rules.named_metrics() - set(gated_metrics))",
        "        ungated: list[str] = []",
        "a tolerance for a metric nobody gates passes silently",
        "tests/plugin/test_plugin_review_workflow.py",
    ),
    # 14: range statistics and weight-cast rows
    _m(
        "metrics.py",
        "torch.count_nonzero(magnitude < tiny),",
        "torch.count_nonzero(magnitude <= tiny),",
        "the tie at the underflow threshold, which rounds up to a normal, counted as underflow",
        "tests/unit/test_range_stats.py",
    ),
    _m(
        "metrics.py",
        "return (info.tiny - half_subnormal) / scale, half_subnormal / scale, overflow / scale",
        "return info.tiny / scale, half_subnormal / scale, overflow / scale",
        "values that round up to tiny counted as underflow",
        "tests/unit/test_range_stats.py",
    ),
    _m(
        "metrics.py",
        "below_tiny - zeros - nonfinite,",
        "below_tiny - nonfinite,",
        "exact zeros counted as underflow",
        "tests/unit/test_range_stats.py",
    ),
    _m(
        "comparison.py",
        "range_values = range_sums(reference, self.range_dtype, scale=scale)",
        "range_values = range_sums(reference, self.range_dtype)",
        "range statistics of gradients ignore the fp16 loss scale",
        "tests/unit/test_range_stats.py",
    ),
    _m(
        "comparison.py",
        "return torch_dtype(variant.param_dtype or variant.dtype)",
        "return torch_dtype(variant.param_dtype or variant.weight_dtype)",
        "autocast variants counted in their fp32 weight dtype",
        "tests/unit/test_range_stats.py",
    ),
    _m(
        "comparison.py",
        "for parameter_name, parameter in model.named_parameters():  # tied ones once",
        "for parameter_name, parameter in model.named_parameters(remove_duplicate=False):",
        "a tied weight measured twice",
        "tests/unit/test_weight_cast.py",
    ),
    _m(
        "comparison.py",
        "if self.range_dtype is not None and kind not in NO_RANGE_KINDS:",
        "if self.range_dtype is not None:",
        "logprob and loss rows get range statistics",
        "tests/unit/test_range_stats.py",
    ),
    _m(
        "tolerance.py",
        "    return [m for m in metrics if m in OPTIONAL_METRICS and all(r.metric(m) is None for r in present)]",
        "    return []",
        "a limit or gate on range statistics of a run without them passes, having checked nothing",
        "tests/unit/test_metric_tolerances.py",
        "tests/unit/test_range_stats.py",
    ),
    _m(
        "checkpoint_run.py",
        "    if recorded != digest:",
        "    if recorded is None:",
        "a saved reference of other weights is measured against",
        "tests/unit/test_cli_run.py",
    ),
    _m(
        "checkpoint_run.py",
        "        if wanted.digest() != ref.batch.digest():",
        "        if wanted.shapes() != ref.batch.shapes():",
        "a saved reference of other tokens of the same shape is reused",
        "tests/unit/test_cli_run.py",
    ),
    _m(
        "checkpoint_run.py",
        "    if options.forward_only is not None and options.forward_only == ref.backward:",
        "    if options.forward_only is not None and options.forward_only != ref.backward:",
        "--forward-only against a reference with backward is accepted",
        "tests/unit/test_cli_run.py",
    ),
    _m(
        "checkpoint.py",
        "                while chunk := handle.read(1 << 24):\n                    hasher.update(chunk)",
        "                hasher.update(handle.read(64))",
        "the weights digest reads only the header: a changed weight is not seen",
        "tests/unit/test_cli_run.py",
    ),
    _m(
        "run_outputs.py",
        "    if not overwrite and directory.is_dir() and any(directory.iterdir()):",
        "    if not overwrite and directory.is_dir() and (directory / REPORT_FILE).exists():",
        "a folder holding other files is written into",
        "tests/unit/test_cli_run.py",
    ),
    _m(
        "run_outputs.py",
        '            for path in logprobs.glob("*.npy"):',
        '            for path in logprobs.glob("reference.npy"):',
        "--overwrite leaves an earlier run's variant log-probs beside the new ones",
        "tests/unit/test_cli_run.py",
    ),
    _m(
        "run_outputs.py",
        '        array[~mask.to("cpu", torch.bool)] = float("nan")',
        '        array[mask.to("cpu", torch.bool)] = float("nan")',
        "the log-prob files hide the counted positions instead of the others",
        "tests/unit/test_cli_run.py",
    ),
    _m(
        "progress.py",
        "    return left * sum(finished) / len(finished)",
        "    return sum(finished) / len(finished)",
        "the estimate counts one run whatever is left",
        "tests/unit/test_progress.py",
    ),
    _m(
        "comparison.py",
        '        runner.progress = RunProgress(progress, reference_variant.name, "reference", 1, progress_total)',
        '        runner.progress = RunProgress(progress, reference_variant.name, "variant", 1, progress_total)',
        "the reference run is announced as a variant",
        "tests/unit/test_progress.py",
    ),
    _m(
        "checkpoint_run.py",
        "    if options.tokens < 2 * batch or options.tokens % batch:",
        "    if options.tokens < 2 * batch:",
        "--tokens not a multiple of --batch silently drops tokens",
        "tests/unit/test_cli_run.py",
    ),
    _m(
        "checkpoint.py",
        '        if path.is_file() and (path.name == "config.json" or WEIGHT_FILE.fullmatch(path.name))',
        '        if path.is_file() and (path.name == "config.json" or path.suffix == ".safetensors")',
        "a reference saved beside the weights changes the checkpoint's digest",
        "tests/unit/test_cli_run.py",
    ),
]
