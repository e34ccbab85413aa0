"""The plan of a sync and its wire format: which entry goes into which bucket and where
(`layout`), and the collectives both sides run around the buckets (`exchange`)."""
