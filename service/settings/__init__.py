"""Settings: the flag table, the checks made before anything loads, TGI's launcher on them."""
