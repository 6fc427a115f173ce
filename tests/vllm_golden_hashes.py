import os, json
os.environ.pop("PYTHONHASHSEED", None)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils as k
out = {}
for algo in ["sha256_cbor", "sha256"]:
    for seed in [None, "1234"]:
        if seed: os.environ["PYTHONHASHSEED"] = seed
        else: os.environ.pop("PYTHONHASHSEED", None)
        fn = get_hash_fn_by_name(algo)
        k.init_none_hash(fn)
        toks = list(range(100, 100 + 70))
        for extras_name, extra in [("none", None), ("salt", "salt")]:
            hs = []; prev = None
            for i in range(2):
                ek = None
                if extra and i == 0: ek = (("cache_salt", extra),)
                prev = k.hash_block_tokens(fn, prev, toks[i*32:(i+1)*32], ek)
                hs.append(bytes(prev).hex())
            out[f"{algo}|{seed}|{extras_name}"] = hs
print(json.dumps(out, indent=1))
