"""The use-case tables with tuned settings: every method of a use case (hospital_records.py,
sensor_maintenance.py, keyboard_prediction.py) tuned by fedproto.tune with the same budget, on a
validation share of each client's training data, then retrained over the tables' seeds (1, 2, 3)
and scored on the test data (docs/tuning.md).

    python examples/tune_usecases.py hospitals --trials 10
    python examples/tune_usecases.py sensors --trials 10 --out tune-sensors

Needs the tune extra (Optuna) and, for sensors and keyboard, the examples extra.
"""

from __future__ import annotations

import argparse
import os
import sys

import fedproto

USECASES = {
    # name -> (module, classes, rounds, the example's fixed options, methods)
    "hospitals": ("hospital_records", 2, 30, {"batch_size": 16}, ["fedproto", "local", "fd"]),
    "sensors": ("sensor_maintenance", 4, 20, {"momentum": 0.9, "batch_size": 8}, ["fedproto", "local", "fd"]),
    "keyboard": ("keyboard_prediction", None, 10, {"momentum": 0.9, "batch_size": 32}, ["fedproto", "local", "fd"]),
}
"""Each use case as its example runs it (the example's lr, 0.05, is searched)."""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("usecase", choices=sorted(USECASES))
    parser.add_argument("--trials", type=int, default=10, help="trials per method")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default: the example's)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="output folder (default: tune-<usecase>)")
    args = parser.parse_args(argv)
    module, classes, rounds, options, methods = USECASES[args.usecase]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    example = __import__(module)
    if classes is None:
        classes = example.CLASSES
    from rich.console import Console

    result = fedproto.tune({"lambda_proto": "log:0.01:10", "lr": "log:0.005:0.5"}, clients=example.make_clients,
                           num_classes=classes, method=methods[0], baselines=methods[1:], trials=args.trials, seed=1,
                           options={"rounds": args.rounds or rounds, **options}, threads=args.threads,
                           out=args.out or f"tune-{args.usecase}", final_seeds=3, console=Console())
    print(open(result.files["table"], encoding="utf-8").read())
    return result


if __name__ == "__main__":
    main()
