"""A model of the attention kernel's causal grid with its Q pipeline (bench/NOTES.md v17f).

Items (causal query blocks, in the kernel's order: heads in L2-sized groups, each group
longest block first) are claimed by 132 persistent CTAs from one counter. A CTA claims
its next item when a Q slot frees (two slots: when its item L-2 ends); the item's Q then
needs Tq µs (load and quantization) before the item can start. An item of m+1 KV tiles
takes (m+1)·t + O + diag µs (t, O from NOTES v16e at d=128; diag: the masked tile).
Prints the makespan and the CTAs' mean wait for Q, for Tq = 0, 3 and 6 µs.

    python3 bench/models/causal_q_pipeline.py
"""
import heapq
def sim(order, ctas=132, t=1.335, O=2.26, diag=1.0, Tq=6.0, slots=2):
    # per CTA state: ends of its items; claims happen in time order across CTAs
    ends=[[] for _ in range(ctas)]
    ready=[[] for _ in range(ctas)]
    # claim events: (time, cta); initially each CTA claims `slots` items at time 0
    ev=[(0.0,c,i) for c in range(ctas) for i in range(slots)]
    heapq.heapify(ev)
    nxt=0; busy_wait=0.0
    last_end=[0.0]*ctas
    pending=[[] for _ in range(ctas)]  # items claimed, not started, in order
    while ev and nxt < len(order):
        tc,c,_=heapq.heappop(ev)
        m=order[nxt]; nxt+=1
        r=tc+Tq
        start=max(last_end[c], r)
        busy_wait+=max(0.0, r-last_end[c])
        dur=(m+1)*t+O+diag
        end=start+dur
        last_end[c]=end
        # this item's slot frees at its end -> the claim of item L+2 happens then
        heapq.heappush(ev,(end,c,0))
    return max(last_end), busy_wait/ctas
def groups_lpt(heads,nmb,group):
    out=[]
    for g0 in range(0,heads,group):
        ing=min(group,heads-g0)
        for i in range(ing*nmb): out.append(nmb-1-i//ing)
    return out
for N in (1024,2048,4096):
    nmb=N//128; heads=128
    g=min(heads,max(1,(24<<20)//(2*N*128)))
    base=groups_lpt(heads,nmb,g)
    ideal=sum((m+1)*1.335+2.26+1.0 for m in base)/132
    for Tq in (0.0,3.0,6.0):
        T,w=sim(base,Tq=Tq)
        print(f"N={N} group={g} Tq={Tq}: makespan {T:7.1f} us, ideal {ideal:7.1f}, wait/CTA {w:5.1f} us ({100*w/T:4.1f}%)")
