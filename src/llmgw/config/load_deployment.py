"""Read one deployment file (`ctl apply FILE`) into a Deployment, as one about to be applied.

The file's I/O lives here, beside the other loaders, so that config/deployment.py, which
the server's pure cores import to rebuild stored deployments, stays a function of data.
"""

from __future__ import annotations

import yaml

from llmgw.config.deployment import parse_deployment
from llmgw.config.vllm_serve import apply_refusal
from llmgw.errors import DeploymentError
from llmgw.model.deployment import Deployment


def load_deployment(path: str) -> Deployment:
    """Read and validate one deployment file, as one about to be applied."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise DeploymentError(path, "", f"cannot read: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise DeploymentError(path, "", f"not valid YAML: {exc}") from None
    d = parse_deployment(data, path)
    refusal = apply_refusal(d)
    if refusal:
        raise DeploymentError(path, "args", refusal)
    return d
