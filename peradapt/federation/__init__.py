"""The federated round engine, run directories, checkpoints and client state."""

from peradapt.federation.engine import default_run_dir, resume_config, train
from peradapt.federation.session import RunPaths, Session, build_session

__all__ = ["RunPaths", "Session", "build_session", "default_run_dir", "resume_config", "train"]
