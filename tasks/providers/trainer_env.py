"""The environment a local trainer starts with: an allow-list of the controller's, plus the job's `env`.

The controller holds secrets a trainer never needs (the Prefect auth string, the history database's URL,
Slack tokens, its AWS keys): a trainer runs the job's recipe and whatever that imports, so it gets only
the variables named here, those the job's `env.pass` names, and the job's `env.set`. The secrets
(trainer/spec/job.py `never_passed`) stay out even when named. S3 storage from a local trainer uses the AWS
settings that pass (a profile, the credentials and config files, the region), never the keys.
"""

from __future__ import annotations

from collections.abc import Mapping

from spotrun.trainer.spec.job import EnvOptions, never_passed

PASSED = frozenset(
    {"PATH", "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX", "HOME", "USER", "LOGNAME", "TMPDIR", "TZ", "LANG",
     "LANGUAGE", "TERM", "LD_LIBRARY_PATH", "HF_HOME", "HF_HUB_OFFLINE", "HF_HUB_CACHE",
     "HF_DATASETS_OFFLINE", "HF_DATASETS_CACHE", "TRANSFORMERS_OFFLINE", "XDG_CACHE_HOME", "MASTER_ADDR",
     "MASTER_PORT",
     "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY",
     "http_proxy", "https_proxy", "no_proxy"}
)  # fmt: skip  # a packed list of names, grouped by purpose
# What the trainer itself reads (SPOTRUN_HOME, SPOTRUN_MANIFEST_KEY, SPOTRUN_IMDS_ENDPOINT, ...), the
# interpreter's, CUDA's and NCCL's settings, torch's and torchrun's, thread and allocator settings, the
# locale, and AWS settings (not its keys: never_passed wins)
PASSED_PREFIXES = (
    "SPOTRUN_", "PYTHON", "CUDA_", "NVIDIA_", "NCCL_", "GLOO_", "TORCH", "PYTORCH_", "TRITON_", "OMP_",
    "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "MALLOC_", "GLIBC_TUNABLES", "LC_", "AWS_",
)  # fmt: skip  # a packed list of names, grouped by purpose


def passes(name: str, named: frozenset[str] = frozenset()) -> bool:
    """Whether the controller's `name` reaches a trainer: allow-listed or `named` by the job, not a secret."""
    if never_passed(name):
        return False
    return name in PASSED or name.startswith(PASSED_PREFIXES) or name in named


def trainer_env(
    environ: Mapping[str, str], env: EnvOptions, own: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The trainer's environment: the allow-listed and `env.pass`-named part of `environ`, then the job's
    `env.set`, then `own` (what spotrun sets for this worker: it wins)."""
    named = frozenset(env.pass_)
    kept = {k: v for k, v in environ.items() if passes(k, named)}
    return {**kept, **env.set_, **(own or {})}
