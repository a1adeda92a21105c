import os

# Tests run on the CPU (JAX_PLATFORMS=cuda runs them on a GPU); 8 simulated devices let
# sharding tests build real meshes. float32 products are exact on a GPU too (no TF32), so
# the float32 tolerances mean the same there.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags += " --xla_force_host_platform_device_count=8"
# On the CPU, XLA without backend optimisation (compiles, most of the suite's time, about a
# third shorter) and with its older fusion emitters (about a fifth shorter again); the
# numbers are the same to float tolerance.
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in flags:
    flags += " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = flags.strip()


import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small corpus of 40 Python-like files for training tests."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "import", "class", "for", "in", "if", "(", ")", ":"]
    for i in range(40):
        text = "\n".join(" ".join(rng.choice(words, 8)) for _ in range(30))
        (root / f"f{i:02d}.py").write_text(text)
    return root
