//! The policy's seccomp filter (`strata_agent_proto::policy`) as one classic-BPF program:
//! the architecture checked, then a binary search over the syscall numbers, whose leaves
//! answer (allow, EPERM for a denied syscall, ENOSYS for an unlisted one) or, for `ioctl`,
//! `clone` and `socket`, look at the arguments the policy refuses.
//!
//! Why not seccompiler's compiler (its loader is still used): it emits one comparison
//! chain per listed syscall, and the policy's allowlist and refusals came to two programs
//! of 1,775 and 427 instructions, which the kernel checks, translates and JIT-compiles at
//! every sandbox start (0.76 ms measured, on every container's create → first exec) and
//! walks linearly at every syscall it has no cached answer for. The search over ranges of
//! numbers with one answer is 266 instructions (most of them the argument refusals) and a
//! few comparisons deep: loading it takes 0.1 ms.

use std::collections::BTreeSet;

use seccompiler::{sock_filter, BpfProgram};
use strata_agent_proto::policy;

// Instruction codes (linux/bpf_common.h).
const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
const AND_K: u16 = 0x54; // BPF_ALU | BPF_AND | BPF_K
const JA: u16 = 0x05; // BPF_JMP | BPF_JA
const JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
const JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
const RET_K: u16 = 0x06; // BPF_RET | BPF_K

// Answers (linux/seccomp.h).
const RET_KILL_PROCESS: u32 = 0x8000_0000;
const RET_ERRNO: u32 = 0x0005_0000;
const RET_ALLOW: u32 = 0x7fff_0000;

/// The kernel's longest accepted program (BPF_MAXINSNS).
const MAX_INSNS: usize = 4096;

// Offsets in `struct seccomp_data`: nr, arch, instruction pointer, then six 64-bit
// arguments, whose low half comes first on a little-endian machine.
const NR: u32 = 0;
const ARCH: u32 = 4;
#[cfg(target_endian = "little")]
const fn arg(i: u32, high: bool) -> u32 {
    16 + 8 * i + if high { 4 } else { 0 }
}
#[cfg(target_endian = "big")]
const fn arg(i: u32, high: bool) -> u32 {
    16 + 8 * i + if high { 0 } else { 4 }
}

/// The audit architecture of this build's syscalls (linux/audit.h).
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xc000_00b7;

/// What the policy answers for a syscall number before its arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Allow,
    /// Denied by name: EPERM.
    Refuse,
    /// Neither allowed nor denied: [`policy::UNLISTED_ERRNO`].
    Unlisted,
    /// Allowed but for the arguments the policy refuses.
    Ioctl,
    Clone,
    Socket,
}

/// The policy's syscalls by number on this build's architecture.
struct Numbers {
    allowed: BTreeSet<u32>,
    denied: BTreeSet<u32>,
}

impl Numbers {
    fn of_policy() -> Numbers {
        let numbers = |names| {
            policy::resolve(names)
                .filter_map(|(_, nr)| u32::try_from(nr).ok())
                .collect()
        };
        Numbers {
            allowed: numbers(policy::ALLOWED_SYSCALLS),
            denied: numbers(policy::DENIED_SYSCALLS),
        }
    }

    fn answer(&self, nr: u32) -> Answer {
        if self.denied.contains(&nr) {
            return Answer::Refuse;
        }
        if !self.allowed.contains(&nr) {
            return Answer::Unlisted;
        }
        match i64::from(nr) {
            libc::SYS_ioctl => Answer::Ioctl,
            libc::SYS_clone => Answer::Clone,
            libc::SYS_socket => Answer::Socket,
            _ => Answer::Allow,
        }
    }

    /// Every syscall number, as the ranges of one answer: (first number, answer), in
    /// order, the first starting at 0 and each running to the next's start (the last to
    /// u32::MAX).
    fn ranges(&self) -> Vec<(u32, Answer)> {
        let mut starts = std::collections::BTreeMap::from([(0, self.answer(0))]);
        for &nr in self.allowed.union(&self.denied) {
            starts.insert(nr, self.answer(nr));
            if let Some(next) = nr.checked_add(1) {
                starts.insert(next, self.answer(next));
            }
        }
        let mut starts: Vec<(u32, Answer)> = starts.into_iter().collect();
        // Neighbours with one answer are one range ([`Answer::Ioctl`] and the like stand
        // for one number each, so they never merge).
        starts.dedup_by(|next, prev| next.1 == prev.1);
        starts
    }
}

fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

fn ret_errno(errno: i32) -> sock_filter {
    stmt(RET_K, RET_ERRNO | (errno as u32 & 0xffff))
}

/// For each refusal, its parts `(argument offset, mask, value)`, which must all hold
/// (`arg & mask == value`) for an EPERM; then allow.
fn refusals(rules: &[Vec<(u32, u32, u32)>]) -> Vec<sock_filter> {
    let mut out = Vec::new();
    for parts in rules {
        let mut block = Vec::new();
        let mut tests = Vec::new();
        for &(offset, mask, value) in parts {
            block.push(stmt(LD_W_ABS, offset));
            if mask != u32::MAX {
                block.push(stmt(AND_K, mask));
            }
            tests.push(block.len());
            block.push(jump(JEQ_K, value, 0, 0));
        }
        block.push(ret_errno(libc::EPERM));
        // A part that does not hold goes on past this refusal's EPERM.
        for t in tests {
            block[t].jf = (block.len() - t - 1) as u8;
        }
        out.extend(block);
    }
    out.push(stmt(RET_K, RET_ALLOW));
    out
}

/// The instructions answering `answer`, with the syscall number in A.
fn leaf(answer: Answer) -> Vec<sock_filter> {
    match answer {
        Answer::Allow => vec![stmt(RET_K, RET_ALLOW)],
        Answer::Refuse => vec![ret_errno(libc::EPERM)],
        Answer::Unlisted => vec![ret_errno(policy::UNLISTED_ERRNO)],
        // The request is an unsigned int: its low 32 bits are what the kernel reads.
        Answer::Ioctl => refusals(
            &policy::DENIED_IOCTLS
                .iter()
                .map(|r| vec![(arg(1, false), r.mask, r.value)])
                .collect::<Vec<_>>(),
        ),
        // Flags are a 64-bit argument: both halves of each flag are compared.
        Answer::Clone => refusals(
            &policy::NAMESPACE_FLAGS
                .iter()
                .map(|&f| {
                    let (high, low) = ((f >> 32) as u32, f as u32);
                    let mut parts = vec![(arg(0, false), low, low)];
                    if high != 0 {
                        parts.insert(0, (arg(0, true), high, high));
                    }
                    parts
                })
                .collect::<Vec<_>>(),
        ),
        // The family is an int: its low 32 bits.
        Answer::Socket => refusals(
            &policy::DENIED_SOCKET_FAMILIES
                .iter()
                .map(|&(_, family)| vec![(arg(0, false), u32::MAX, family as u32)])
                .collect::<Vec<_>>(),
        ),
    }
}

/// A binary search over `ranges` (with the syscall number in A): each comparison sends
/// the numbers from the middle range's start on to the upper half.
fn search(ranges: &[(u32, Answer)]) -> Vec<sock_filter> {
    if let [(_, answer)] = ranges {
        return leaf(*answer);
    }
    let middle = ranges.len() / 2;
    let (lower, upper) = (search(&ranges[..middle]), search(&ranges[middle..]));
    let start = ranges[middle].0;
    let mut out = Vec::with_capacity(lower.len() + upper.len() + 2);
    match u8::try_from(lower.len()) {
        Ok(over) => out.push(jump(JGE_K, start, over, 0)),
        // Conditional jumps reach 255 instructions ahead; an unconditional one, further.
        Err(_) => {
            out.push(jump(JGE_K, start, 0, 1));
            out.push(stmt(JA, lower.len() as u32));
        }
    }
    out.extend(lower);
    out.extend(upper);
    out
}

/// The policy's filter: a syscall of another architecture kills the process (its
/// numbers mean other calls), then the search.
pub fn program() -> Result<BpfProgram, String> {
    let mut out = vec![
        stmt(LD_W_ABS, ARCH),
        jump(JEQ_K, AUDIT_ARCH, 1, 0),
        stmt(RET_K, RET_KILL_PROCESS),
        stmt(LD_W_ABS, NR),
    ];
    out.extend(search(&Numbers::of_policy().ranges()));
    if out.len() > MAX_INSNS {
        return Err(format!(
            "seccomp: the policy's filter is {} instructions, over the kernel's {MAX_INSNS}",
            out.len()
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the kernel would answer: a classic-BPF interpreter for the instructions this
    /// module emits, over a `seccomp_data` of `arch`, `nr` and `args`.
    fn run(prog: &[sock_filter], arch: u32, nr: u32, args: [u64; 6]) -> u32 {
        let word = |offset: u32| -> u32 {
            match offset {
                NR => nr,
                ARCH => arch,
                o if (16..64).contains(&o) && o % 4 == 0 => {
                    let i = ((o - 16) / 8) as usize;
                    let high = (o - 16) % 8 == 4;
                    if high == cfg!(target_endian = "little") {
                        (args[i] >> 32) as u32
                    } else {
                        args[i] as u32
                    }
                }
                o => panic!("load from offset {o}"),
            }
        };
        let (mut a, mut pc) = (0u32, 0usize);
        loop {
            let i = &prog[pc];
            pc += 1;
            match i.code {
                LD_W_ABS => a = word(i.k),
                AND_K => a &= i.k,
                JA => pc += i.k as usize,
                JEQ_K => pc += if a == i.k { i.jt } else { i.jf } as usize,
                JGE_K => pc += if a >= i.k { i.jt } else { i.jf } as usize,
                RET_K => return i.k,
                c => panic!("unexpected instruction {c:#x}"),
            }
        }
    }

    /// The policy read straight from its lists.
    fn expected(n: &Numbers, nr: u32, args: [u64; 6]) -> u32 {
        let eperm = RET_ERRNO | libc::EPERM as u32;
        if n.denied.contains(&nr) {
            return eperm;
        }
        if !n.allowed.contains(&nr) {
            return RET_ERRNO | policy::UNLISTED_ERRNO as u32;
        }
        let refused = match i64::from(nr) {
            libc::SYS_ioctl => policy::DENIED_IOCTLS
                .iter()
                .any(|r| args[1] as u32 & r.mask == r.value),
            libc::SYS_clone => policy::NAMESPACE_FLAGS.iter().any(|&f| args[0] & f == f),
            libc::SYS_socket => policy::DENIED_SOCKET_FAMILIES
                .iter()
                .any(|&(_, family)| u64::from(args[0] as u32) == family),
            _ => false,
        };
        if refused {
            eperm
        } else {
            RET_ALLOW
        }
    }

    /// A small deterministic generator of argument values.
    struct Values(u64);
    impl Values {
        fn next(&mut self) -> u64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            self.0 ^ (self.0 >> 29)
        }
    }

    /// Every syscall number up to past the highest, numbers of the x32 range and the
    /// extremes, with arguments made to hit and miss each argument refusal: the program
    /// answers as the policy's lists say, and another architecture is killed.
    #[test]
    fn the_program_answers_every_syscall_as_the_policy_lists_say() {
        let prog = program().unwrap();
        assert!(prog.len() < 400, "{} instructions", prog.len());
        let n = Numbers::of_policy();
        let mut numbers: Vec<u32> = (0..1100).collect();
        numbers.extend((0..600).map(|i| 0x4000_0000 + i));
        numbers.extend([
            0x3fff_ffff,
            0x7fff_ffff,
            0x8000_0000,
            u32::MAX - 1,
            u32::MAX,
        ]);
        let mut values = Values(7);
        for &nr in &numbers {
            for _ in 0..4 {
                let args = [(); 6].map(|_| values.next());
                assert_eq!(
                    run(&prog, AUDIT_ARCH, nr, args),
                    expected(&n, nr, args),
                    "nr {nr}"
                );
            }
            assert_eq!(run(&prog, AUDIT_ARCH, nr, [0; 6]), expected(&n, nr, [0; 6]));
            assert_eq!(run(&prog, AUDIT_ARCH ^ 1, nr, [0; 6]), RET_KILL_PROCESS);
        }
        // Each refusal hit, also with its unmasked bits and the high half set, and missed
        // by one bit.
        let (ioctl, clone, socket) = (
            libc::SYS_ioctl as u32,
            libc::SYS_clone as u32,
            libc::SYS_socket as u32,
        );
        let mut cases = Vec::new();
        for r in policy::DENIED_IOCTLS {
            for noise in [
                0u64,
                !u64::from(r.mask),
                0xffff_ffff_0000_0000,
                values.next(),
            ] {
                let req = u64::from(r.value) | (noise & !u64::from(r.mask));
                cases.push((ioctl, [3, req, 0, 0, 0, 0]));
                cases.push((
                    ioctl,
                    [
                        3,
                        req ^ u64::from(r.mask & r.mask.wrapping_neg()),
                        0,
                        0,
                        0,
                        0,
                    ],
                ));
            }
        }
        for &f in policy::NAMESPACE_FLAGS {
            for other in [0u64, 0x11 /* SIGCHLD */, values.next(), u64::MAX] {
                cases.push((clone, [f | other, 0, 0, 0, 0, 0]));
                cases.push((clone, [other & !f, 0, 0, 0, 0, 0]));
            }
        }
        for &(_, family) in policy::DENIED_SOCKET_FAMILIES {
            for high in [0u64, 0xdead_beef_0000_0000] {
                cases.push((socket, [family | high, 1, 0, 0, 0, 0]));
                cases.push((socket, [(family + 1) | high, 1, 0, 0, 0, 0]));
            }
        }
        for _ in 0..20_000 {
            let args = [(); 6].map(|_| values.next());
            cases.extend([(ioctl, args), (clone, args), (socket, args)]);
        }
        let mut refused = 0;
        for (nr, args) in cases {
            let answer = run(&prog, AUDIT_ARCH, nr, args);
            assert_eq!(answer, expected(&n, nr, args), "nr {nr} args {args:x?}");
            refused += usize::from(answer != RET_ALLOW);
        }
        assert!(refused > 100, "the argument refusals were hit: {refused}");
    }

    /// The long-jump form a search over many ranges needs is right too.
    #[test]
    fn a_search_too_wide_for_short_jumps_answers_the_same() {
        let ranges: Vec<(u32, Answer)> = (0..400u32)
            .map(|i| {
                let answer = [Answer::Allow, Answer::Refuse, Answer::Unlisted][i as usize % 3];
                (i * 2, answer)
            })
            .collect();
        let mut prog = vec![stmt(LD_W_ABS, NR)];
        prog.extend(search(&ranges));
        assert!(prog.iter().any(|i| i.code == JA), "long jumps used");
        for nr in 0..820 {
            let want = leaf(ranges[(nr as usize / 2).min(399)].1)[0].k;
            assert_eq!(run(&prog, AUDIT_ARCH, nr, [0; 6]), want, "nr {nr}");
        }
    }
}
