"""Dataset loaders: the shared npz copies, checksums, scaling, search path and failures.

No test touches the network: downloads are replaced by a fake ``pooch.retrieve``.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from dkicf import datasets
from dkicf.datasets import DATASETS, NPZ_SHA256, PAPER_GAMMA, PAPER_SUBSET_SIZE, load_dataset

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"

# (shape of X, class counts), copied from shared/data/README.md
README = {
    "pendigits": ((10992, 16), [1143, 1143, 1144, 1055, 1144, 1055, 1056, 1142, 1055, 1055]),
    "satimage": ((6435, 36), [1533, 703, 1358, 626, 707, 1508]),
    "shuttle": ((43500, 9), [34108, 37, 132, 6748, 2458, 6, 11]),
    "usps": ((9298, 256), [1553, 1269, 929, 824, 852, 716, 834, 792, 708, 821]),
    "mnist": ((60000, 784), [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]),
}


def _shared(name: str) -> Path:
    path = SHARED / f"{name}.npz"
    if not path.is_file():
        pytest.skip(f"{path} is absent: the shared benchmark data is not on this machine")
    return path


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("DKICF_DATA", raising=False)


@pytest.fixture
def no_network(monkeypatch):
    """Every download fails as it would without a network; records the attempts."""
    pooch = pytest.importorskip("pooch")
    requests = pytest.importorskip("requests")
    calls = []

    def refuse(url, known_hash, **kwargs):
        calls.append(url)
        raise requests.exceptions.ConnectionError(f"no route to host for {url}")

    monkeypatch.setattr(pooch, "retrieve", refuse)
    return calls


@pytest.fixture(scope="module")
def mnist_scaled():
    _shared("mnist")
    return load_dataset("mnist", data_home=SHARED, download=False)


@pytest.mark.parametrize("name", [n for n in DATASETS if n != "mnist"])
def test_shared_copy_matches_readme(name):
    _shared(name)
    X, y = load_dataset(name, data_home=SHARED, download=False)
    shape, counts = README[name]
    assert X.shape == shape
    assert X.dtype == np.float64 and X.flags.c_contiguous
    assert y.dtype == np.int64
    assert np.bincount(y).tolist() == counts


def test_mnist_shape_counts_and_scaling(mnist_scaled):
    X, y = mnist_scaled
    shape, counts = README["mnist"]
    assert X.shape == shape
    assert np.bincount(y).tolist() == counts
    assert X.max() == 1.0 and X.min() == 0.0
    assert y[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]


def test_shuttle_is_scaled_to_minus_one_one_with_training_ranges():
    path = _shared("shuttle")
    X, _ = load_dataset("shuttle", data_home=SHARED, download=False)
    assert X.min() >= -1.0 and X.max() <= 1.0
    np.testing.assert_array_equal(X.min(axis=0), -1.0)
    np.testing.assert_array_equal(X.max(axis=0), 1.0)
    with np.load(path) as f:
        raw = f["X"].astype(np.float64)
    # svm-scale: an affine map per feature from [min, max] to [-1, 1]
    lo, hi = raw.min(axis=0), raw.max(axis=0)
    np.testing.assert_allclose(X, 2 * (raw - lo) / (hi - lo) - 1, atol=1e-12)
    X_raw, _ = load_dataset("shuttle", data_home=SHARED, download=False, scale=False)
    np.testing.assert_array_equal(X_raw, raw)


@pytest.mark.parametrize("name", ["pendigits", "satimage"])
def test_scale_keeps_already_scaled_sets_as_stored(name):
    path = _shared(name)
    X, _ = load_dataset(name, data_home=SHARED, download=False, scale=True)
    with np.load(path) as f:
        np.testing.assert_array_equal(X, f["X"].astype(np.float64))
    if name == "pendigits":
        assert X.min() == 0.0 and X.max() == 100.0


# sigma * median pairwise squared distance on the scaled data, from shared/data/README.md:
# order 0.1-5 is a usable kernel, 1e-4 or 1e3 a degenerate one.
README_SIGMA_MEDIAN = {"pendigits": 0.45, "satimage": 0.91, "shuttle": 0.25, "usps": 0.13}


@pytest.mark.parametrize("name", sorted(README_SIGMA_MEDIAN) + ["mnist"])
def test_scaled_data_suits_the_paper_gamma(name, request):
    from scipy.spatial.distance import pdist

    if name == "mnist":
        X, _ = request.getfixturevalue("mnist_scaled")
        expected = 1.63
    else:
        _shared(name)
        X, _ = load_dataset(name, data_home=SHARED, download=False)
        expected = README_SIGMA_MEDIAN[name]
    rows = np.random.default_rng(0).choice(len(X), size=1500, replace=False)
    value = PAPER_GAMMA[name] * np.median(pdist(X[rows], "sqeuclidean"))
    assert expected / 1.3 < value < expected * 1.3


def test_paper_constants():
    assert set(PAPER_GAMMA) == set(DATASETS)
    assert PAPER_GAMMA["pendigits"] == 2.0**-16 and PAPER_GAMMA["shuttle"] == 2.0
    assert PAPER_SUBSET_SIZE == {"pendigits": 25, "satimage": 50, "shuttle": 50, "mnist": 50}


def test_pinned_hashes_match_the_shared_files():
    present = [n for n in DATASETS if (SHARED / f"{n}.npz").is_file()]
    if not present:
        pytest.skip(f"no npz in {SHARED}")
    for name in present:
        digest = hashlib.sha256((SHARED / f"{name}.npz").read_bytes()).hexdigest()
        assert digest == NPZ_SHA256[name], name


def test_corrupted_copy_fails_the_checksum_naming_file_and_hashes(tmp_path):
    rng = np.random.default_rng(0)
    bad = tmp_path / "satimage.npz"
    np.savez_compressed(bad, X=rng.normal(size=(5, 36)).astype(np.float32), y=np.arange(5))
    actual = hashlib.sha256(bad.read_bytes()).hexdigest()
    with pytest.raises(ValueError) as err:
        load_dataset("satimage", data_home=tmp_path, download=False)
    message = str(err.value)
    assert str(bad) in message
    assert actual in message and NPZ_SHA256["satimage"] in message


def test_one_changed_value_of_the_real_file_fails_the_checksum(tmp_path):
    with np.load(_shared("pendigits")) as f:
        X, y = f["X"].copy(), f["y"]
    X[0, 0] += 1
    np.savez_compressed(tmp_path / "pendigits.npz", X=X, y=y)
    with pytest.raises(ValueError, match=r"pendigits\.npz has sha256"):
        load_dataset("pendigits", data_home=tmp_path)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="Unknown dataset 'iris'") as err:
        load_dataset("iris")
    for name in DATASETS:
        assert name in str(err.value)


def test_name_is_case_insensitive():
    _shared("satimage")
    X, _ = load_dataset("SatImage", data_home=SHARED, download=False)
    assert X.shape == README["satimage"][0]


def test_absent_file_without_download_says_where_to_put_it(tmp_path, no_network):
    with pytest.raises(FileNotFoundError, match="download=False") as err:
        load_dataset("usps", data_home=tmp_path, download=False)
    assert str(tmp_path) in str(err.value) and "usps.npz" in str(err.value)
    assert no_network == []


def test_absent_file_and_no_network_gives_a_clear_error(tmp_path, no_network):
    with pytest.raises(FileNotFoundError) as err:
        load_dataset("satimage", data_home=tmp_path)
    message = str(err.value)
    assert "downloading https://www.csie.ntu.edu.tw/" in message and "failed" in message
    assert f"Put satimage.npz (sha256 {NPZ_SHA256['satimage']}" in message
    assert str(tmp_path) in message
    assert no_network == [datasets.LIBSVM_URL + "satimage.scale"]


def test_missing_pooch_asks_for_the_datasets_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pooch", None)  # import pooch -> ImportError
    with pytest.raises(ImportError, match=r'pip install "dkicf\[datasets\]"'):
        load_dataset("mnist", data_home=tmp_path)


def test_env_var_is_the_only_folder_searched(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("DKICF_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=str(tmp_path)) as err:
        load_dataset("pendigits", download=False)
    assert str(SHARED) not in str(err.value)
    shutil.copy(_shared("pendigits"), tmp_path / "pendigits.npz")
    X, _ = load_dataset("pendigits", download=False)
    assert X.shape == README["pendigits"][0]


def test_cwd_relative_shared_data_is_searched_first(tmp_path, monkeypatch):
    folder = tmp_path / "shared" / "data"
    folder.mkdir(parents=True)
    (folder / "usps.npz").write_bytes(b"not the usps file")
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    with pytest.raises(ValueError, match="usps.npz has sha256") as err:
        load_dataset("usps", download=False)
    assert str(folder) in str(err.value)


def _dump_libsvm(X, labels, path):
    from sklearn.datasets import dump_svmlight_file

    dump_svmlight_file(X, labels, str(path), zero_based=False)


def test_download_path_parses_libsvm_files_into_the_npz_layout(tmp_path, monkeypatch):
    pooch = pytest.importorskip("pooch")
    with np.load(_shared("satimage")) as f:
        X, y = f["X"], f["y"]
    source = tmp_path / "libsvm"
    source.mkdir()
    # LIBSVM layout: 4,435 training rows, 2,000 test rows, labels 1..6
    _dump_libsvm(X[:4435], y[:4435] + 1, source / "satimage.scale")
    _dump_libsvm(X[4435:], y[4435:] + 1, source / "satimage.scale.t")
    calls = []

    def fake_retrieve(url, known_hash, *, fname, path, **kwargs):
        calls.append((url, known_hash, fname, Path(path)))
        return str(source / fname)

    monkeypatch.setattr(pooch, "retrieve", fake_retrieve)
    home = tmp_path / "home"
    X2, y2 = load_dataset("satimage", data_home=home)
    np.testing.assert_array_equal(X2, X.astype(np.float64))
    np.testing.assert_array_equal(y2, y)
    assert [c[2] for c in calls] == ["satimage.scale", "satimage.scale.t"]
    assert all(c[0] == datasets.LIBSVM_URL + c[2] and c[3] == home for c in calls)


def test_downloaded_files_with_wrong_class_counts_are_refused(tmp_path, monkeypatch):
    pooch = pytest.importorskip("pooch")
    rng = np.random.default_rng(0)
    path = tmp_path / "shuttle.scale"
    _dump_libsvm(rng.uniform(-1, 1, size=(30, 9)), rng.integers(1, 8, 30), path)
    monkeypatch.setattr(pooch, "retrieve", lambda *a, **k: str(path))
    with pytest.raises(ValueError, match=r"class counts .* expected \[34108, 37"):
        load_dataset("shuttle", data_home=tmp_path / "home")


def test_usps_and_mnist_downloads_are_pinned():
    pinned = {f: h for files in datasets._LIBSVM_FILES.values() for f, h in files}
    assert pinned["usps.bz2"] == "md5:ec16c51db3855ca6c91edd34d0e9b197"
    assert pinned["usps.t.bz2"] == "md5:8ea070ee2aca1ac39742fdd1ef5ed118"
    assert pinned["mnist.scale.bz2"].startswith("md5:")


def test_downloaded_pendigits_without_its_16th_feature_is_refused(tmp_path, monkeypatch):
    # The defect the data README found in one copy of the raw LIBSVM pendigits.
    pooch = pytest.importorskip("pooch")
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(10), README["pendigits"][1])
    X = rng.integers(1, 101, size=(len(y), 16)).astype(float)
    X[:, 15] = 0.0
    _dump_libsvm(X[:7494], y[:7494], tmp_path / "pendigits")
    _dump_libsvm(X[7494:], y[7494:], tmp_path / "pendigits.t")
    monkeypatch.setattr(pooch, "retrieve", lambda url, h, *, fname, **k: str(tmp_path / fname))
    with pytest.raises(ValueError, match=r"no value for feature\(s\) \[16\]"):
        load_dataset("pendigits", data_home=tmp_path / "home")
