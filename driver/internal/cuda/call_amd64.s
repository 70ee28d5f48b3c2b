#include "textflag.h"
#include "go_asm.h"

// trampoline<> calls args.fn with args.a[0:6] in DI, SI, DX, CX, R8, R9 and
// args.a[6:14] on the stack, and stores AX in args.r. runtime.cgocall runs it
// on the g0 stack with the C ABI, DI = &args, SP = 8 mod 16 at entry. It
// keeps the callee-saved registers it uses (BP, BX).
TEXT trampoline<>(SB), NOSPLIT|NOFRAME, $0
	PUSHQ BP
	MOVQ  SP, BP
	PUSHQ BX
	MOVQ  DI, BX
	SUBQ  $72, SP // 8 stack words + 8 bytes of padding: SP = 0 mod 16 at the CALL

	MOVQ (callArgs_a+6*8)(BX), R10
	MOVQ R10, 0(SP)
	MOVQ (callArgs_a+7*8)(BX), R10
	MOVQ R10, 8(SP)
	MOVQ (callArgs_a+8*8)(BX), R10
	MOVQ R10, 16(SP)
	MOVQ (callArgs_a+9*8)(BX), R10
	MOVQ R10, 24(SP)
	MOVQ (callArgs_a+10*8)(BX), R10
	MOVQ R10, 32(SP)
	MOVQ (callArgs_a+11*8)(BX), R10
	MOVQ R10, 40(SP)
	MOVQ (callArgs_a+12*8)(BX), R10
	MOVQ R10, 48(SP)
	MOVQ (callArgs_a+13*8)(BX), R10
	MOVQ R10, 56(SP)

	MOVQ (callArgs_a+0*8)(BX), DI
	MOVQ (callArgs_a+1*8)(BX), SI
	MOVQ (callArgs_a+2*8)(BX), DX
	MOVQ (callArgs_a+3*8)(BX), CX
	MOVQ (callArgs_a+4*8)(BX), R8
	MOVQ (callArgs_a+5*8)(BX), R9
	MOVQ callArgs_fn(BX), R10
	XORL AX, AX // no vector registers used, should the callee be variadic
	CALL R10

	MOVQ AX, callArgs_r(BX)
	ADDQ $72, SP
	POPQ BX
	POPQ BP
	RET

GLOBL ·trampolineABI0(SB), NOPTR|RODATA, $8
DATA ·trampolineABI0(SB)/8, $trampoline<>(SB)
