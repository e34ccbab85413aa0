"""The side channel of a sync and what follows a failure: the store's keys, abort
records and the recovery each error calls for (`channel`), and `recover` (`recover`)."""
