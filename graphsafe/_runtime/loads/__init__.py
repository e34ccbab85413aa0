"""A load of one model from its beginning to its end: one `Load` (`load`), the driver that
runs each under the model's lock (`driver`), what failed loads owe (`debts`), what lazy
refresh defers (`deferred`), and `load_state_dict` as a load (`state_dict`).
"""
