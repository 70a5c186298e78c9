"""The job configuration: one schema (schema.py) read from YAML, `key=value` words and flags (load.py,
arguments.py), with every value converted and checked (values.py), LLaMA-Factory and HF Trainer keys mapped or
refused with why (foreign.py), and its docs generated from the schema (docs.py). The names below are the package's
public surface; `from lazytrain.config import JobConfig` etc."""

from lazytrain.config.arguments import add_job_arguments, job_config_from_args
from lazytrain.config.docs import default_of, field_docs, foreign_markdown, markdown_table
from lazytrain.config.load import (
    ALIASES,
    canonical_key,
    job_config_from_dict,
    load_job_config,
    parse_override,
    read_yaml,
)
from lazytrain.config.schema import (
    CORPORA,
    KEYS,
    MAX_STEPS,
    SECTION_OF,
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    JobConfig,
    MetricsConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PlanConfig,
    RuntimeConfig,
)
from lazytrain.config.values import ConfigValueError

__all__ = [
    "ALIASES", "CORPORA", "KEYS", "MAX_STEPS", "SECTIONS", "SECTION_OF",
    "CheckpointConfig", "ConfigValueError", "DataConfig", "JobConfig", "MetricsConfig", "ModelConfig",
    "OptimConfig", "ParallelConfig", "PlanConfig", "RuntimeConfig", "add_job_arguments", "canonical_key",
    "default_of", "field_docs", "foreign_markdown", "job_config_from_args", "job_config_from_dict", "load_job_config",
    "markdown_table", "parse_override", "read_yaml",
]
