// The SageBwd backward on the GPU against its emulation and FP64, and its speed, in one
// program over the C ABI (bench/NOTES.md v23 quotes its output). Build on the GPU machine
// after the library (QATTN_TARGETS=qattn python/build_on_device.sh):
//   nvcc -std=c++20 -O2 -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude \
//     bench/sagebwd_check.cpp build-py/libqattn.a -o /tmp/sagebwd_check
//   /tmp/sagebwd_check      # accuracy: CosSim / rel-L1 vs the emulator and vs FP64
//   /tmp/sagebwd_check t    # timing: backward and forward, CUDA events, 10 calls
// Inputs: N(0,1) bf16, K shifted by +0.5 (a channel mean, so K smoothing matters).
#include <cuda_runtime.h>
#include <cstdio>
#include <cmath>
#include <random>
#include <vector>
#include <chrono>
#include "qattn/qattn.h"
#include "emulate/sagebwd.h"
#include "reference/attention_fp64.h"
#include "reference/metrics.h"
#include "numerics/formats.h"
using namespace qattn;
static uint16_t b16(float x){return numerics::bf16_bits(x);} static float f16(uint16_t b){return numerics::bf16_from_bits(b);}
struct Dev{void* p=nullptr; Dev(size_t n){cudaMalloc(&p,n+256); cudaMemset(p,0xff,n+256);} ~Dev(){cudaFree(p);} };
static double cosv(const std::vector<float>& a,const std::vector<float>& b){double ab=0,aa=0,bb=0;for(size_t i=0;i<a.size();++i){ab+=double(a[i])*b[i];aa+=double(a[i])*a[i];bb+=double(b[i])*b[i];}return ab/std::sqrt(aa*bb+1e-300);}
static double rl1(const std::vector<float>& a,const std::vector<float>& ref){double num=0,den=0;for(size_t i=0;i<a.size();++i){num+=std::fabs(double(a[i])-ref[i]);den+=std::fabs(ref[i]);}return num/(den+1e-300);}
int run(int B,int Hq,int Hkv,int Nq,int Nkv,int d,int causal,int dov,int det,bool timing){
  std::mt19937 rng(1234+Nq*7+d+causal);
  std::normal_distribution<float> nd(0,1);
  Tensor4 q(B,Hq,Nq,d),k(B,Hkv,Nkv,d),v(B,Hkv,Nkv,d),dout(B,Hq,Nq,d);
  for(auto* t:{&q,&k,&v,&dout}) for(auto& x:t->data) x=f16(b16(nd(rng)));
  for(auto& x:k.data) x=f16(b16(x+0.5f)); // K with a mean: smoothing matters
  auto up=[&](const Tensor4& t){ Dev* dv=new Dev(t.data.size()*2); std::vector<uint16_t> h(t.data.size()); for(size_t i=0;i<h.size();++i)h[i]=b16(t.data[i]); cudaMemcpy(dv->p,h.data(),h.size()*2,cudaMemcpyHostToDevice); return dv;};
  Dev *dq_=up(q),*dk_=up(k),*dv_=up(v),*ddo=up(dout);
  Dev o_d(size_t(B)*Hq*Nq*d*2), lse_d(size_t(B)*Hq*Nq*4);
  auto tq=[&](void* p,int H,int N){qattn_tensor t{p,int64_t(H)*N*d,int64_t(N)*d,d};return t;};
  qattn_fwd_params fp; qattn_fwd_params_init(&fp);
  fp.q=tq(dq_->p,Hq,Nq); fp.k=tq(dk_->p,Hkv,Nkv); fp.v=tq(dv_->p,Hkv,Nkv); fp.o=tq(o_d.p,Hq,Nq); fp.lse=(float*)lse_d.p;
  fp.dtype=QATTN_DTYPE_BF16; fp.batch=B; fp.heads_q=Hq; fp.heads_kv=Hkv; fp.seqlen_q=Nq; fp.seqlen_kv=Nkv; fp.head_dim=d; fp.causal=causal; fp.sage2.granularity=QATTN_QK_PER_BLOCK;
  size_t fws=0; if(qattn_fwd_workspace_size(&fp,&fws)){printf("fwd ws err %s\n",qattn_last_error_message());return 1;}
  Dev fw(fws); if(qattn_fwd(&fp,fw.p,fws,nullptr)){printf("fwd err %s\n",qattn_last_error_message());return 1;}
  Dev gq(size_t(B)*Hq*Nq*d*2), gk(size_t(B)*Hkv*Nkv*d*2), gv(size_t(B)*Hkv*Nkv*d*2);
  qattn_bwd_params bp; qattn_bwd_params_init(&bp);
  bp.q=fp.q; bp.k=fp.k; bp.v=fp.v; bp.o=fp.o; bp.dout=tq(ddo->p,Hq,Nq); bp.lse=(float*)lse_d.p;
  bp.dq=tq(gq.p,Hq,Nq); bp.dk=tq(gk.p,Hkv,Nkv); bp.dv=tq(gv.p,Hkv,Nkv);
  bp.dtype=QATTN_DTYPE_BF16; bp.batch=B; bp.heads_q=Hq; bp.heads_kv=Hkv; bp.seqlen_q=Nq; bp.seqlen_kv=Nkv; bp.head_dim=d; bp.causal=causal; bp.sm_scale=1.0f/std::sqrt(float(d)); bp.dov=dov; bp.deterministic=det;
  size_t bws=0; if(qattn_bwd_workspace_size(&bp,&bws)){printf("bwd ws err %s\n",qattn_last_error_message());return 1;}
  Dev bw(bws);
  int e=qattn_bwd(&bp,bw.p,bws,nullptr); cudaError_t se=cudaDeviceSynchronize();
  if(e||se){printf("bwd err %d %s %s\n",e,qattn_last_error_message(),cudaGetErrorString(se));return 1;}
  if(timing){
    cudaEvent_t a,b; cudaEventCreate(&a); cudaEventCreate(&b);
    for(int i=0;i<3;++i) qattn_bwd(&bp,bw.p,bws,nullptr);
    cudaEventRecord(a); int R=10; for(int i=0;i<R;++i) qattn_bwd(&bp,bw.p,bws,nullptr); cudaEventRecord(b); cudaEventSynchronize(b);
    float ms=0; cudaEventElapsedTime(&ms,a,b); ms/=R;
    cudaEventRecord(a); for(int i=0;i<R;++i) qattn_fwd(&fp,fw.p,fws,nullptr); cudaEventRecord(b); cudaEventSynchronize(b);
    float fms=0; cudaEventElapsedTime(&fms,a,b); fms/=R;
    double fl=4.0*B*Hq*double(Nq)*Nkv*d*(causal?0.5:1.0);
    printf("TIMING B=%d H=%d N=%d d=%d causal=%d dov=%d det=%d: bwd %.3f ms (%.0f TOPS-eq x2.5), fwd %.3f ms (%.0f TOPS), fwdbwd %.0f TOPS-eq\n",B,Hq,Nq,d,causal,dov,det,ms,fl*2.5/ms/1e9,fms,fl/fms/1e9,fl*3.5/(ms+fms)/1e9);
    return 0;
  }
  auto down=[&](void* p,size_t n){std::vector<uint16_t> h(n); cudaMemcpy(h.data(),p,n*2,cudaMemcpyDeviceToHost); std::vector<float> f(n); for(size_t i=0;i<n;++i)f[i]=f16(h[i]); return f;};
  Tensor4 o(B,Hq,Nq,d); o.data=down(o_d.p,o.data.size());
  std::vector<float> lse(size_t(B)*Hq*Nq); cudaMemcpy(lse.data(),lse_d.p,lse.size()*4,cudaMemcpyDeviceToHost);
  auto G_q=down(gq.p,q.data.size()), G_k=down(gk.p,k.data.size()), G_v=down(gv.p,v.data.size());
  AttentionParams prm; prm.mask=causal?Mask::Causal:Mask::None;
  emulate::SageBwdOptions opt; opt.dov=dov?emulate::DoVFormat::Quantized:emulate::DoVFormat::Fp16;
  opt.pds_block_keys=64;  // the kernel's scales per warpgroup (tile.cuh, TileFrags)
  auto em=emulate::sagebwd_backward(q,k,v,o,lse,dout,prm,opt);
  auto ref=reference::attention_backward(q,k,v,dout,prm);
  auto tof=[](const Tensor4d& t){std::vector<float> f(t.data.size()); for(size_t i=0;i<f.size();++i)f[i]=float(t.data[i]); return f;};
  auto rq=tof(ref.dq), rk=tof(ref.dk), rv=tof(ref.dv);
  int nonfin=0; for(auto* g:{&G_q,&G_k,&G_v}) for(float x:*g) if(!std::isfinite(x)) ++nonfin;
  printf("B%d Hq%d Hkv%d Nq%d Nkv%d d%d c%d dov%d det%d | vs emu cos dq %.6f dk %.6f dv %.6f rl1 %.4f %.4f %.4f | vs fp64 gpu cos %.5f %.5f %.5f emu %.5f %.5f %.5f | nonfinite %d\n",B,Hq,Hkv,Nq,Nkv,d,causal,dov,det,
    cosv(G_q,em.dq.data),cosv(G_k,em.dk.data),cosv(G_v,em.dv.data),rl1(G_q,em.dq.data),rl1(G_k,em.dk.data),rl1(G_v,em.dv.data),
    cosv(G_q,rq),cosv(G_k,rk),cosv(G_v,rv),cosv(em.dq.data,rq),cosv(em.dk.data,rk),cosv(em.dv.data,rv),nonfin);
  delete dq_; delete dk_; delete dv_; delete ddo;
  return 0;
}
int main(int argc,char**argv){
  if(argc>1){ // timing
    for(int d:{128,64}) for(int c:{0,1}) for(int det:{0,1}) run(1,32,32,4096,4096,d,c,0,det,true);
    run(1,16,16,16384,16384,128,0,0,0,true);
    return 0;}
  run(1,1,1,128,128,64,0,0,0,false);
  run(1,2,2,256,256,128,0,0,0,false);
  run(1,2,2,256,256,128,0,0,1,false);
  run(1,2,2,200,333,128,1,0,0,false);
  run(2,4,1,77,130,64,1,0,1,false);
  run(1,4,2,1024,1024,128,1,0,0,false);
  run(1,4,2,1024,1024,128,0,1,0,false);
  run(1,2,2,300,100,96,1,0,0,false);
  run(1,2,2,1024,1024,64,0,0,0,false);
  run(1,2,2,1000,1000,128,1,0,1,false);
  run(1,8,8,2048,2048,128,1,0,0,false);
  return 0;
}
