"""Fit once, save the model to Zarr (no pickle), load it elsewhere and predict new data.

    python examples/save_and_predict.py [--n 3000] [--model model.zarr] [--overwrite]
"""

import argparse

import numpy as np

import dkicf
from dkicf import io
from dkicf.synthetic import make_zigzag


def main(argv=None):
    parser = argparse.ArgumentParser(description="save a model and predict with it")
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--model", default="zigzag-model.zarr", help="where to save the model")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a model already saved there")
    args = parser.parse_args(argv)

    # Refused before any work if a model is already there (unless --overwrite).
    try:
        io.check_writable(args.model, overwrite=args.overwrite)
    except io.DkicfIOError as exc:
        parser.error(str(exc).replace("overwrite=True", "--overwrite"))
    X, y = make_zigzag(args.n, random_state=0)
    model = dkicf.KernelKMeans(n_clusters=2, gamma=8.0, rank=50, random_state=0).fit(X)
    model.save(args.model, overwrite=args.overwrite)

    loaded = dkicf.load(args.model)
    X_new, _ = make_zigzag(500, random_state=1)
    same = np.array_equal(loaded.predict(X_new), model.predict(X_new))
    print(f"saved to {args.model}; loaded model predicts identically: {same}")


if __name__ == "__main__":
    main()
