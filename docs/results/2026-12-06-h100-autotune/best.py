import json,glob,collections,sys
rows=[json.loads(l) for f in glob.glob(sys.argv[1]+'/*.jsonl') for l in open(f)]
best=collections.defaultdict(dict)
for r in rows:
    if not r.get('matmul'): continue
    key=(r['shape'],r['m'])
    fam=r['config'].split('_')[0]
    if fam not in best[key] or r['us']<best[key][fam][0]: best[key][fam]=(r['us'],r['config'])
for key in sorted(best):
    print(key, '  '.join(f"{f}:{v[0]:.1f}({v[1][len(f)+1:]})" for f,v in sorted(best[key].items()) if f in ('mma','mmabulk','mmastaged','wgmma')))
print(sum(1 for r in rows if r.get('ok') is False), 'not ok', [r['config'] for r in rows if r.get('ok') is False][:10])
