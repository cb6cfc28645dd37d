from setuptools import find_packages, setup

setup(
    name="triton_dist",
    version="0.1.0",
    description="Compute-communication overlapping kernels in stock Triton",
    packages=find_packages(include=["triton_dist", "triton_dist.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "triton>=3.3", "numpy", "nvidia-ml-py"],
    extras_require={"test": ["pytest>=7", "pytest-timeout", "pytest-xdist", "transformers"]},
)
