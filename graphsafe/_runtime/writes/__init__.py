"""The ways writes into a model are seen: a load's tracker at the dispatcher, in its thread
(`tracking`); the process-wide observer while pinned (`observer`); the witnesses of
every input and buffer, taken at each refresh (`watch`). The journal that records them
all is `graphsafe._memory.journal`.
"""
