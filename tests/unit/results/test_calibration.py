"""results/speed-calibration.json: the same file from the same records on any CPU."""

import json

from finetune_kit.planning.speed import Efficiency
from finetune_tools.results import calibration
from tests.harness import REPO


def test_the_fitted_file_ignores_the_solves_last_digits(monkeypatch):
    """LAPACK's least-squares solve differs in its last digits between CPUs (measured: 4e-8 relative
    between two EPYC generations); the written constants must not."""
    fitted = calibration.fit_efficiency([o for o, _ in calibration.observations(REPO / "results")])

    def nudged(factor):
        return Efficiency({k: v * factor for k, v in fitted.compute.items()},
                          {k: v * factor for k, v in fitted.step_s_per_param.items()},
                          fitted.adam_params_per_s_per_core * factor, fitted.compiled * factor)

    texts = []
    for factor in (1 - 4e-8, 1 + 4e-8):
        monkeypatch.setattr(calibration, "fit_efficiency", lambda _runs, f=factor: nudged(f))
        texts.append(calibration.fitted_json(REPO / "results"))
    assert texts[0] == texts[1]
    written = json.loads(texts[0])
    assert written["compute"]["full"] == float(f"{fitted.compute['full']:.4g}")
    assert written["adam_params_per_s_per_core"] == float(f"{fitted.adam_params_per_s_per_core:.4g}")
