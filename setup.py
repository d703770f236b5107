"""Distribution dp-fedemb: user-level DP embedding training with TFF, Beam and TFX.

Dependencies are pinned in requirements/lock.txt and installed with uv (see
Makefile); install_requires only names the direct dependencies so that a plain
`pip install -e .` in a prepared environment does not try to re-resolve them.
"""

import setuptools

setuptools.setup(
    name="dp-fedemb",
    version="0.1.0",
    description=(
        "Image-embedding training with user-level differential privacy "
        "(DP-FedEmb, DP-FTRL-FedEmb) on TensorFlow Federated, Beam and TFX."
    ),
    python_requires=">=3.10,<3.11",
    packages=setuptools.find_packages(include=["tff_algorithms*", "beam_jobs*", "pipeline*"]),
    install_requires=[
        "tensorflow==2.14.1",
        "tensorflow-federated==0.87.0",
        "tensorflow-privacy==0.9.0",
        "dp-accounting==0.4.3",
        "tfx==1.15.1",
        "apache-beam[gcp]==2.59.0",
        "absl-py",
    ],
    entry_points={"console_scripts": ["dp-fedemb = pipeline.cli:console_main"]},
)
