"""The `precision` fixture's object: run a comparison for the test, with the session's reference cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from pytest_precision.base.errors import ConfigurationError, NotSupportedHere, PrecisionError
from pytest_precision.plugin.session import ASSERTED_KEY, TABLES_KEY, PrecisionSession, marker_isolate

if TYPE_CHECKING:
    from pytest_precision.engine.references import Reference, ReferenceCache
    from pytest_precision.reports.report import PrecisionReport


#: The session's memoized reference runs (see PrecisionRunner.cache).
REFERENCE_CACHE_KEY = pytest.StashKey["ReferenceCache"]()


class PrecisionRunner:
    """The `precision` fixture: `precision.run(model, inputs, variants=[...], **compare_kwargs)`, or
    `ref = precision.reference(model, inputs)` then `precision.run(ref, variants=[...])`."""

    def __init__(self, item: pytest.Item, device: str, session: PrecisionSession) -> None:
        self._item = item
        self._session = session
        self.device = device

    @property
    def cache(self) -> ReferenceCache:
        """The session-wide cache of reference runs, created on first use (one per process)."""
        from pytest_precision.engine.references import ReferenceCache

        stash = self._item.config.stash
        cache = stash.get(REFERENCE_CACHE_KEY, None)
        if cache is None:
            cache = stash[REFERENCE_CACHE_KEY] = ReferenceCache()
        return cache

    @staticmethod
    def _fail_on_bad_stem(baseline: object) -> None:
        __tracebackhide__ = True
        from pytest_precision.gate.baseline import checked_stem

        try:
            checked_stem(baseline)
        except ConfigurationError as error:
            message = f"ConfigurationError: {error}"
        pytest.fail(message, pytrace=False)

    def reference(self, model: Any, inputs: Any, **reference_kwargs: Any) -> Reference:
        """`pytest_precision.reference` on the session's device, memoized in the session's cache."""
        __tracebackhide__ = True
        from pytest_precision.engine.reference_run import reference

        reference_kwargs.setdefault("device", self.device)
        reference_kwargs.setdefault("cache", self.cache)
        try:
            return reference(model, inputs, **reference_kwargs)
        except PrecisionError as error:
            message = f"{type(error).__name__}: {error}"
        pytest.fail(message, pytrace=False)

    def run(
        self,
        model: Any,
        inputs: Any = None,
        variants: Any = None,
        *,
        baseline: str | None = None,
        **compare_kwargs: Any,
    ) -> PrecisionReport:
        """`pytest_precision.compare` on the session's device; the tables are kept for --precision-tables.

        `model` may be a Reference (from `precision.reference`); otherwise the reference run is memoized in
        the session's cache (same model object, parameter values, inputs and options: computed once).
        Comparing against a baseline, fp16 variants reuse the loss scale recorded there (unless `loss_scale=`
        is given), so a gradient crossing a power of two cannot make the gate flap; `baseline` names the
        stem when the test passes one to assert_precision_within too.
        """
        __tracebackhide__ = True
        from pytest_precision.engine.compare import compare
        from pytest_precision.engine.references import Reference
        from pytest_precision.gate.baseline import stem_problem

        if baseline is not None and (not isinstance(baseline, str) or stem_problem(baseline) is not None):
            self._fail_on_bad_stem(baseline)
        try:
            isolate = marker_isolate(self._item)
        except ConfigurationError as error:
            pytest.fail(f"{type(error).__name__}: {error}", pytrace=False)
        if isolate is not None:
            compare_kwargs.setdefault("isolate", isolate)
        if isinstance(model, Reference):
            device = str(compare_kwargs.get("device") or model.device)
        else:
            compare_kwargs.setdefault("device", self.device)
            compare_kwargs.setdefault("cache", self.cache)
            device = str(compare_kwargs["device"])
        if "loss_scale" not in compare_kwargs and not self._session.update:
            scales = self._session.recorded_loss_scales(self._item, baseline, device)
            from pytest_precision.distributed import ranks as distributed

            if distributed.active():  # rank 0's file decides, on every rank
                scales = distributed.exchange(scales)[0]
            if scales:
                compare_kwargs["loss_scale"] = scales
        try:
            report = compare(model, inputs, variants, **compare_kwargs)
        except NotSupportedHere as error:  # a variant this machine cannot run: a skip that says why
            pytest.skip(str(error))
        except PrecisionError as error:
            message = f"{type(error).__name__}: {error}"
        else:
            self._item.stash.setdefault(TABLES_KEY, []).append(report.format(full=False))
            self._item.stash.setdefault(ASSERTED_KEY, False)
            return report
        pytest.fail(message, pytrace=False)
