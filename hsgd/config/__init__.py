"""The run's configuration: typed schema (`schema`), validation (`validate`), output paths (`paths`).

Every key of the schema is public contract (README, "Configuration"). The names most callers need
are importable from here.
"""
from hsgd.config.paths import OUTPUT_ROOT_ENV, RAY_JOB_OUTPUT_ROOT, output_path, output_root, under_ray_job
from hsgd.config.schema import (BACKENDS, INNER_ALGORITHMS, INNER_OPTIMIZERS, OUTER_ALGORITHMS, PLACEMENT_STRATEGIES,
                                WANDB_MODES, ConfigError, HsgdConfig, register_resolvers, register_schema)
from hsgd.config.validate import (CHOICE_FIELDS, NUMERIC_FIELDS, Bound, field_value, validate,
                                  wandb_credentials_found)

__all__ = ["OUTPUT_ROOT_ENV", "RAY_JOB_OUTPUT_ROOT", "output_path", "output_root", "under_ray_job", "BACKENDS",
           "INNER_ALGORITHMS", "INNER_OPTIMIZERS", "OUTER_ALGORITHMS", "PLACEMENT_STRATEGIES", "WANDB_MODES",
           "ConfigError", "HsgdConfig", "register_resolvers", "register_schema", "validate",
           "Bound", "CHOICE_FIELDS", "NUMERIC_FIELDS", "field_value", "wandb_credentials_found"]
