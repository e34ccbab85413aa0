"""The receiving side of a sync, stage by stage: the metadata and the verdict on it
(`metadata`), the transfer into staging (`transfer`), the loader calls (`loading`), and
the entry point that composes them into the report (`receiver`, `report`)."""
