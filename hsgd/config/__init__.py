"""The run's configuration; the names most callers need are importable from here."""

from hsgd.config.paths import output_path
from hsgd.config.schema import ConfigError, HsgdConfig, register_schema
from hsgd.config.validate import CHOICE_FIELDS, NUMERIC_FIELDS, field_value, validate
