"builtin.module"() ({
  "func.func"() <{function_type = (tensor<16x3x3x3xf32>, tensor<8x3x32x32xf32>, tensor<32x16x3x3xf32>, tensor<8x16x32x32xf32>, tensor<8x16x32x32xf32>, tensor<8x16x16x16xf32>, tensor<8x16x16x16xi64>, tensor<8x32x16x16xf32>, tensor<8x32x16x16xf32>, tensor<8x512xf32>, tensor<512x10xf32>, tensor<8x10xf32>) -> (tensor<16x3x3x3xf32>, tensor<16xf32>, tensor<32x16x3x3xf32>, tensor<32xf32>, tensor<10x512xf32>, tensor<10xf32>), sym_name = "main"}> ({
  ^bb0(%arg0: tensor<16x3x3x3xf32>, %arg1: tensor<8x3x32x32xf32>, %arg2: tensor<32x16x3x3xf32>, %arg3: tensor<8x16x32x32xf32>, %arg4: tensor<8x16x32x32xf32>, %arg5: tensor<8x16x16x16xf32>, %arg6: tensor<8x16x16x16xi64>, %arg7: tensor<8x32x16x16xf32>, %arg8: tensor<8x32x16x16xf32>, %arg9: tensor<8x512xf32>, %arg10: tensor<512x10xf32>, %arg11: tensor<8x10xf32>):
    %0 = "stablehlo.dot_general"(%arg11, %arg10) {dot_dimension_numbers = #stablehlo.dot<lhs_batching_dimensions = [], rhs_batching_dimensions = [], lhs_contracting_dimensions = [1], rhs_contracting_dimensions = [1]>, precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]} : (tensor<8x10xf32>, tensor<512x10xf32>) -> tensor<8x512xf32>
    %1 = "stablehlo.dot_general"(%arg11, %arg9) {dot_dimension_numbers = #stablehlo.dot<lhs_batching_dimensions = [], rhs_batching_dimensions = [], lhs_contracting_dimensions = [0], rhs_contracting_dimensions = [0]>, precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]} : (tensor<8x10xf32>, tensor<8x512xf32>) -> tensor<10x512xf32>
    %2 = "stablehlo.constant"() {value = dense<0.000000e+00> : tensor<f32>} : () -> tensor<f32>
    %3 = "stablehlo.reduce"(%arg11, %2) ({
    ^bb0(%arg16: tensor<f32>, %arg17: tensor<f32>):
      %83 = "stablehlo.add"(%arg16, %arg17) : (tensor<f32>, tensor<f32>) -> tensor<f32>
      "stablehlo.return"(%83) : (tensor<f32>) -> ()
    }) {dimensions = array<i64: 0>} : (tensor<8x10xf32>, tensor<f32>) -> tensor<10xf32>
    %4 = "stablehlo.reshape"(%3) : (tensor<10xf32>) -> tensor<1x10xf32>
    %5 = "stablehlo.reshape"(%4) : (tensor<1x10xf32>) -> tensor<10xf32>
    %6 = "stablehlo.reshape"(%0) : (tensor<8x512xf32>) -> tensor<8x32x4x4xf32>
    %7 = "stablehlo.constant"() {value = dense<[0, 4, 8, 12]> : tensor<4xi64>} : () -> tensor<4xi64>
    %8 = "stablehlo.broadcast_in_dim"(%7) {broadcast_dimensions = array<i64: 1>} : (tensor<4xi64>) -> tensor<16x4xi64>
    %9 = "stablehlo.constant"() {value = dense<[4, 8, 12, 16]> : tensor<4xi64>} : () -> tensor<4xi64>
    %10 = "stablehlo.broadcast_in_dim"(%9) {broadcast_dimensions = array<i64: 1>} : (tensor<4xi64>) -> tensor<16x4xi64>
    %11 = "stablehlo.iota"() {iota_dimension = 0 : i64} : () -> tensor<16x4xi64>
    %12 = "stablehlo.compare"(%11, %8) {compare_type = #stablehlo<comparison_type SIGNED>, comparison_direction = #stablehlo<comparison_direction GE>} : (tensor<16x4xi64>, tensor<16x4xi64>) -> tensor<16x4xi1>
    %13 = "stablehlo.compare"(%11, %10) {compare_type = #stablehlo<comparison_type SIGNED>, comparison_direction = #stablehlo<comparison_direction LT>} : (tensor<16x4xi64>, tensor<16x4xi64>) -> tensor<16x4xi1>
    %14 = "stablehlo.and"(%12, %13) : (tensor<16x4xi1>, tensor<16x4xi1>) -> tensor<16x4xi1>
    %15 = "stablehlo.subtract"(%10, %8) : (tensor<16x4xi64>, tensor<16x4xi64>) -> tensor<16x4xi64>
    %16 = "stablehlo.convert"(%15) : (tensor<16x4xi64>) -> tensor<16x4xf32>
    %17 = "stablehlo.constant"() {value = dense<1.000000e+00> : tensor<f32>} : () -> tensor<f32>
    %18 = "stablehlo.broadcast_in_dim"(%17) {broadcast_dimensions = array<i64>} : (tensor<f32>) -> tensor<16x4xf32>
    %19 = "stablehlo.divide"(%18, %16) : (tensor<16x4xf32>, tensor<16x4xf32>) -> tensor<16x4xf32>
    %20 = "stablehlo.broadcast_in_dim"(%2) {broadcast_dimensions = array<i64>} : (tensor<f32>) -> tensor<16x4xf32>
    %21 = "stablehlo.select"(%14, %19, %20) : (tensor<16x4xi1>, tensor<16x4xf32>, tensor<16x4xf32>) -> tensor<16x4xf32>
    %22 = "stablehlo.iota"() {iota_dimension = 0 : i64} : () -> tensor<16x4xi64>
    %23 = "stablehlo.compare"(%22, %8) {compare_type = #stablehlo<comparison_type SIGNED>, comparison_direction = #stablehlo<comparison_direction GE>} : (tensor<16x4xi64>, tensor<16x4xi64>) -> tensor<16x4xi1>
    %24 = "stablehlo.compare"(%22, %10) {compare_type = #stablehlo<comparison_type SIGNED>, comparison_direction = #stablehlo<comparison_direction LT>} : (tensor<16x4xi64>, tensor<16x4xi64>) -> tensor<16x4xi1>
    %25 = "stablehlo.and"(%23, %24) : (tensor<16x4xi1>, tensor<16x4xi1>) -> tensor<16x4xi1>
    %26 = "stablehlo.subtract"(%10, %8) : (tensor<16x4xi64>, tensor<16x4xi64>) -> tensor<16x4xi64>
    %27 = "stablehlo.convert"(%26) : (tensor<16x4xi64>) -> tensor<16x4xf32>
    %28 = "stablehlo.divide"(%18, %27) : (tensor<16x4xf32>, tensor<16x4xf32>) -> tensor<16x4xf32>
    %29 = "stablehlo.select"(%25, %28, %20) : (tensor<16x4xi1>, tensor<16x4xf32>, tensor<16x4xf32>) -> tensor<16x4xf32>
    %30 = "stablehlo.dot_general"(%6, %21) {dot_dimension_numbers = #stablehlo.dot<lhs_batching_dimensions = [], rhs_batching_dimensions = [], lhs_contracting_dimensions = [2], rhs_contracting_dimensions = [1]>, precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]} : (tensor<8x32x4x4xf32>, tensor<16x4xf32>) -> tensor<8x32x4x16xf32>
    %31 = "stablehlo.dot_general"(%30, %29) {dot_dimension_numbers = #stablehlo.dot<lhs_batching_dimensions = [], rhs_batching_dimensions = [], lhs_contracting_dimensions = [2], rhs_contracting_dimensions = [1]>, precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]} : (tensor<8x32x4x16xf32>, tensor<16x4xf32>) -> tensor<8x32x16x16xf32>
    %32 = "stablehlo.broadcast_in_dim"(%2) {broadcast_dimensions = array<i64>} : (tensor<f32>) -> tensor<8x32x16x16xf32>
    %33 = "stablehlo.compare"(%arg8, %32) {compare_type = #stablehlo<comparison_type FLOAT>, comparison_direction = #stablehlo<comparison_direction LE>} : (tensor<8x32x16x16xf32>, tensor<8x32x16x16xf32>) -> tensor<8x32x16x16xi1>
    %34 = "stablehlo.select"(%33, %32, %31) : (tensor<8x32x16x16xi1>, tensor<8x32x16x16xf32>, tensor<8x32x16x16xf32>) -> tensor<8x32x16x16xf32>
    %35 = "stablehlo.reverse"(%arg2) {dimensions = array<i64: 2, 3>} : (tensor<32x16x3x3xf32>) -> tensor<32x16x3x3xf32>
    %36 = "stablehlo.convolution"(%34, %35) {batch_group_count = 1 : i64, dimension_numbers = #stablehlo.conv<[b, f, 0, 1]x[i, o, 0, 1]->[b, f, 0, 1]>, feature_group_count = 1 : i64, lhs_dilation = array<i64: 1, 1>, padding = dense<1> : tensor<2x2xi64>, precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>], rhs_dilation = array<i64: 1, 1>, window_strides = array<i64: 1, 1>} : (tensor<8x32x16x16xf32>, tensor<32x16x3x3xf32>) -> tensor<8x16x16x16xf32>
    %37 = "stablehlo.convolution"(%arg5, %34) {batch_group_count = 1 : i64, dimension_numbers = #stablehlo.conv<[f, b, 0, 1]x[i, o, 0, 1]->[f, b, 0, 1]>, feature_group_count = 1 : i64, lhs_dilation = array<i64: 1, 1>, padding = dense<1> : tensor<2x2xi64>, precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>], rhs_dilation = array<i64: 1, 1>, window_strides = array<i64: 1, 1>} : (tensor<8x16x16x16xf32>, tensor<8x32x16x16xf32>) -> tensor<32x16x3x3xf32>
    %38 = "stablehlo.reduce"(%34, %2) ({
    ^bb0(%arg14: tensor<f32>, %arg15: tensor<f32>):
      %82 = "stablehlo.add"(%arg14, %arg15) : (tensor<f32>, tensor<f32>) -> tensor<f32>
      "stablehlo.return"(%82) : (tensor<f32>) -> ()
    }) {dimensions = array<i64: 0, 2, 3>} : (tensor<8x32x16x16xf32>, tensor<f32>) -> tensor<32xf32>
    %39 = "stablehlo.iota"() {iota_dimension = 2 : i64} : () -> tensor<8x16x16x16xi64>
    %40 = "stablehlo.iota"() {iota_dimension = 3 : i64} : () -> tensor<8x16x16x16xi64>
    %41 = "stablehlo.constant"() {value = dense<64> : tensor<i64>} : () -> tensor<i64>
    %42 = "stablehlo.broadcast_in_dim"(%41) {broadcast_dimensions = array<i64>} : (tensor<i64>) -> tensor<8x16x16x16xi64>
    %43 = "stablehlo.multiply"(%39, %42) : (tensor<8x16x16x16xi64>, tensor<8x16x16x16xi64>) -> tensor<8x16x16x16xi64>
    %44 = "stablehlo.constant"() {value = dense<2> : tensor<i64>} : () -> tensor<i64>
    %45 = "stablehlo.broadcast_in_dim"(%44) {broadcast_dimensions = array<i64>} : (tensor<i64>) -> tensor<8x16x16x16xi64>
    %46 = "stablehlo.multiply"(%40, %45) : (tensor<8x16x16x16xi64>, tensor<8x16x16x16xi64>) -> tensor<8x16x16x16xi64>
    %47 = "stablehlo.add"(%43, %46) : (tensor<8x16x16x16xi64>, tensor<8x16x16x16xi64>) -> tensor<8x16x16x16xi64>
    %48 = "stablehlo.constant"() {value = dense<0> : tensor<i64>} : () -> tensor<i64>
    %49 = "stablehlo.broadcast_in_dim"(%48) {broadcast_dimensions = array<i64>} : (tensor<i64>) -> tensor<8x16x16x16xi64>
    %50 = "stablehlo.add"(%47, %49) : (tensor<8x16x16x16xi64>, tensor<8x16x16x16xi64>) -> tensor<8x16x16x16xi64>
    %51 = "stablehlo.compare"(%arg6, %50) {compare_type = #stablehlo<comparison_type SIGNED>, comparison_direction = #stablehlo<comparison_direction EQ>} : (tensor<8x16x16x16xi64>, tensor<8x16x16x16xi64>) -> tensor<8x16x16x16xi1>
    %52 = "stablehlo.broadcast_in_dim"(%2) {broadcast_dimensions = array<i64>} : (tensor<f32>) -> tensor<8x16x16x16xf32>
    %53 = "stablehlo.select"(%51, %36, %52) : (tensor<8x16x16x16xi1>, tensor<8x16x16x16xf32>, tensor<8x16x16x16xf32>) -> tensor<8x16x16x16xf32>
    %54 = "stablehlo.pad"(%53, %2) {edge_padding_high = array<i64: 0, 0, 1, 1>, edge_padding_low = array<i64: 0, 0, 0, 0>, interior_padding = array<i64: 0, 0, 1, 1>} : (tensor<8x16x16x16xf32>, tensor<f32>) -> tensor<8x16x32x32xf32>
    %55 = "stablehlo.constant"() {value = dense<1> : tensor<i64>} : () -> tensor<i64>
    %56 = "stablehlo.broadcast_in_dim"(%55) {broadcast_dimensions = array<i64>} : (tensor<i64>) -> tensor<8x16x16x16xi64>
    %57 = "stablehlo.add"(%47, %56) : (tensor<8x16x16x16xi64>, tensor<8x16x16x16xi64>) -> tensor<8x16x16x16xi64>
    %58 = "stablehlo.compare"(%arg6, %57) {compare_type = #stablehlo<comparison_type SIGNED>, comparison_direction = #stablehlo<comparison_direction EQ>} : (tensor<8x16x16x16xi64>, tensor<8x16x16x16xi64>) -> tensor<8x16x16x16xi1>
    %59 = "stablehlo.select"(%58, %36, %52) : (tensor<8x16x16x16xi1>, tensor<8x16x16x16xf32>, tensor<8x16x16x16xf32>) -> tensor<8x16x16x16xf32>
    %60 = "stablehlo.pad"(%59, %2) {edge_padding_high = array<i64: 0, 0, 1, 0>, edge_padding_low = array<i64: 0, 0, 0, 1>, interior_padding = array<i64: 0, 0, 1, 1>} : (tensor<8x16x16x16xf32>, tensor<f32>) -> tensor<8x16x32x32xf32>
    %61 = "stablehlo.add"(%54, %60) : (tensor<8x16x32x32xf32>, tensor<8x16x32x32xf32>) -> tensor<8x16x32x32xf32>
    %62 = "stablehlo.constant"() {value = dense<32> : tensor<i64>} : () -> tensor<i64>
    %63 = "stablehlo.broadcast_in_dim"(%62) {broadcast_dimensions = array<i64>} : (tensor<i64>) -> tensor<8x16x16x16xi64>
    %64 = "stablehlo.add"(%47, %63) : (tensor<8x16x16x16xi64>, tensor<8x16x16x16xi64>) -> tensor<8x16x16x16xi64>
    %65 = "stablehlo.compare"(%arg6, %64) {compare_type = #stablehlo<comparison_type SIGNED>, comparison_direction = #stablehlo<comparison_direction EQ>} : (tensor<8x16x16x16xi64>, tensor<8x16x16x16xi64>) -> tensor<8x16x16x16xi1>
    %66 = "stablehlo.select"(%65, %36, %52) : (tensor<8x16x16x16xi1>, tensor<8x16x16x16xf32>, tensor<8x16x16x16xf32>) -> tensor<8x16x16x16xf32>
    %67 = "stablehlo.pad"(%66, %2) {edge_padding_high = array<i64: 0, 0, 0, 1>, edge_padding_low = array<i64: 0, 0, 1, 0>, interior_padding = array<i64: 0, 0, 1, 1>} : (tensor<8x16x16x16xf32>, tensor<f32>) -> tensor<8x16x32x32xf32>
    %68 = "stablehlo.add"(%61, %67) : (tensor<8x16x32x32xf32>, tensor<8x16x32x32xf32>) -> tensor<8x16x32x32xf32>
    %69 = "stablehlo.constant"() {value = dense<33> : tensor<i64>} : () -> tensor<i64>
    %70 = "stablehlo.broadcast_in_dim"(%69) {broadcast_dimensions = array<i64>} : (tensor<i64>) -> tensor<8x16x16x16xi64>
    %71 = "stablehlo.add"(%47, %70) : (tensor<8x16x16x16xi64>, tensor<8x16x16x16xi64>) -> tensor<8x16x16x16xi64>
    %72 = "stablehlo.compare"(%arg6, %71) {compare_type = #stablehlo<comparison_type SIGNED>, comparison_direction = #stablehlo<comparison_direction EQ>} : (tensor<8x16x16x16xi64>, tensor<8x16x16x16xi64>) -> tensor<8x16x16x16xi1>
    %73 = "stablehlo.select"(%72, %36, %52) : (tensor<8x16x16x16xi1>, tensor<8x16x16x16xf32>, tensor<8x16x16x16xf32>) -> tensor<8x16x16x16xf32>
    %74 = "stablehlo.pad"(%73, %2) {edge_padding_high = array<i64: 0, 0, 0, 0>, edge_padding_low = array<i64: 0, 0, 1, 1>, interior_padding = array<i64: 0, 0, 1, 1>} : (tensor<8x16x16x16xf32>, tensor<f32>) -> tensor<8x16x32x32xf32>
    %75 = "stablehlo.add"(%68, %74) : (tensor<8x16x32x32xf32>, tensor<8x16x32x32xf32>) -> tensor<8x16x32x32xf32>
    %76 = "stablehlo.broadcast_in_dim"(%2) {broadcast_dimensions = array<i64>} : (tensor<f32>) -> tensor<8x16x32x32xf32>
    %77 = "stablehlo.compare"(%arg4, %76) {compare_type = #stablehlo<comparison_type FLOAT>, comparison_direction = #stablehlo<comparison_direction LE>} : (tensor<8x16x32x32xf32>, tensor<8x16x32x32xf32>) -> tensor<8x16x32x32xi1>
    %78 = "stablehlo.select"(%77, %76, %75) : (tensor<8x16x32x32xi1>, tensor<8x16x32x32xf32>, tensor<8x16x32x32xf32>) -> tensor<8x16x32x32xf32>
    %79 = "stablehlo.convolution"(%arg1, %78) {batch_group_count = 1 : i64, dimension_numbers = #stablehlo.conv<[f, b, 0, 1]x[i, o, 0, 1]->[f, b, 0, 1]>, feature_group_count = 1 : i64, lhs_dilation = array<i64: 1, 1>, padding = dense<1> : tensor<2x2xi64>, precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>], rhs_dilation = array<i64: 1, 1>, window_strides = array<i64: 1, 1>} : (tensor<8x3x32x32xf32>, tensor<8x16x32x32xf32>) -> tensor<16x3x3x3xf32>
    %80 = "stablehlo.reduce"(%78, %2) ({
    ^bb0(%arg12: tensor<f32>, %arg13: tensor<f32>):
      %81 = "stablehlo.add"(%arg12, %arg13) : (tensor<f32>, tensor<f32>) -> tensor<f32>
      "stablehlo.return"(%81) : (tensor<f32>) -> ()
    }) {dimensions = array<i64: 0, 2, 3>} : (tensor<8x16x32x32xf32>, tensor<f32>) -> tensor<16xf32>
    "func.return"(%79, %80, %37, %38, %1, %5) : (tensor<16x3x3x3xf32>, tensor<16xf32>, tensor<32x16x3x3xf32>, tensor<32xf32>, tensor<10x512xf32>, tensor<10xf32>) -> ()
  }) : () -> ()
}) : () -> ()
